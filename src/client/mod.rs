//! Gateway-side helpers, from the `ringlimit-client` crate (`client/`): the 429
//! contract (`Retry-After` rounded up, both header families) that the CLI renders
//! answers with. A gateway depends on `ringlimit-client` directly.

pub use ringlimit_client::contract::{ceil_secs, headers, Quota};
