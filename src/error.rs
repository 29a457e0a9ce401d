//! The error of the request layer and its one conversion to a gRPC status.
//!
//! Lower layers keep their own enums (`AlgorithmError`, `RulesError`, `ShardError`);
//! this is the only place any error becomes a `tonic::Status`, so the mapping from
//! "what went wrong" to "what the caller is told" is reviewed in one spot.

use crate::shard::ShardError;

/// Why a check could not be decided.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CheckError {
    /// The request is malformed; nothing was charged. `field` is a path into the
    /// request (e.g. `descriptors[1].cost`, `checks[3].key`).
    #[error("{field}: {reason}")]
    InvalidArgument {
        /// Where in the request the problem is.
        field: String,
        /// What is wrong, in words a caller can act on.
        reason: String,
    },
    /// The deciding shard could not answer.
    #[error(transparent)]
    Shard(#[from] ShardError),
}

impl CheckError {
    /// Shorthand for an invalid-argument error.
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl From<CheckError> for tonic::Status {
    fn from(error: CheckError) -> Self {
        match &error {
            CheckError::InvalidArgument { .. } => {
                tonic::Status::invalid_argument(error.to_string())
            }
            CheckError::Shard(ShardError::Overloaded(_)) => {
                tonic::Status::resource_exhausted(error.to_string())
            }
            CheckError::Shard(ShardError::Stopped(_)) => {
                tonic::Status::unavailable(error.to_string())
            }
        }
    }
}
