//! Reservations at the seam: `Reserve` and `Commit` input, validated and planned for
//! every front end (and for the peer face, which plans a forwarded reservation with the
//! same code), then sent through the router.
//!
//! A reservation is a one-descriptor check whose cost is its amount: the same
//! validation, rule matching and counter identity as a `Check`, and a verdict built the
//! same way. Field names are the `ringlimit.v1` request's (`key`, `route`, `tier`,
//! `amount`, `ttl_ms`; `reservation_id`, `actual`). Nothing is charged for input that
//! fails here, and a commit refused here changes nothing.

use crate::algorithms::Millis;
use crate::check::plan::{self, At, FieldNames, Leaf};
use crate::check::{CheckError, CheckInput, Checker, DescriptorInput, Verdict};
use crate::cluster::reservation::{Hold, ReservationError, ReservationId};
use crate::cluster::{CheckItem, Decided, DescriptorOutcome};
use crate::config::bounds::{DEFAULT_RESERVATION_TTL_MS, MAX_COST, MAX_RESERVATION_TTL_MS};
use crate::config::rules::RuleSet;
use crate::shard::reservations::Settled;

/// A `Reserve` as a front end hands it over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReserveInput<'a> {
    /// Who is limited (1..=256 bytes).
    pub key: &'a str,
    /// `METHOD /path` or `/path`.
    pub route: &'a str,
    /// Optional tier.
    pub tier: Option<&'a str>,
    /// Units to reserve; required, 1..=[`MAX_COST`] and no more than the matched rule
    /// admits at once.
    pub amount: Option<i64>,
    /// How long the reservation waits for its commit, in ms; `None`:
    /// [`DEFAULT_RESERVATION_TTL_MS`].
    pub ttl_ms: Option<i64>,
}

/// A `Commit` as a front end hands it over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitInput<'a> {
    /// The id a `Reserve` answered.
    pub reservation_id: &'a str,
    /// Units the work used, 0..=[`MAX_COST`].
    pub actual: i64,
}

/// A validated reservation: its check (cost = amount) and its TTL.
#[derive(Debug, Clone)]
pub struct PlannedReserve {
    /// The one descriptor, planned like a check's.
    pub item: CheckItem,
    /// Time until an uncommitted reservation is committed at its amount.
    pub ttl_ms: u64,
}

/// A reservation's verdict: the check's, and the id when allowed.
#[derive(Debug)]
pub struct ReserveVerdict {
    /// The check of the amount, as `Check` would answer it.
    pub verdict: Verdict,
    /// Set when allowed: the id `Commit` names.
    pub reservation_id: Option<String>,
    /// When an uncommitted reservation is committed at its amount (owner's Unix ms);
    /// 0 when denied.
    pub expires_at: Millis,
}

/// What a commit did: the owner's account, and who applied it.
pub type CommitVerdict = crate::cluster::reservation::Committed;

/// How a reservation's fields are named: the request's own, the cost being `amount`.
struct ReserveNames;

impl FieldNames for ReserveNames {
    fn field(&self, _at: At, leaf: Leaf) -> String {
        match leaf {
            Leaf::Cost => "amount".into(),
            leaf => leaf.as_str().into(),
        }
    }

    fn descriptors(&self, _check: Option<usize>) -> String {
        "key".into()
    }
}

/// Validate a reservation and match its rule; `rules` are this node's.
pub fn plan_reserve(
    input: &ReserveInput<'_>,
    rules: &RuleSet,
) -> Result<PlannedReserve, CheckError> {
    let amount = input
        .amount
        .ok_or_else(|| CheckError::invalid("amount", "required: the units to reserve"))?;
    let ttl_ms = match input.ttl_ms {
        None => DEFAULT_RESERVATION_TTL_MS,
        Some(t) if t < 1 => {
            return Err(CheckError::invalid(
                "ttl_ms",
                format!("must be a positive number of milliseconds (got {t})"),
            ))
        }
        Some(t) if t > MAX_RESERVATION_TTL_MS => {
            return Err(CheckError::invalid(
                "ttl_ms",
                format!("{t} is over the limit of {MAX_RESERVATION_TTL_MS} (one hour)"),
            ))
        }
        Some(t) => t as u64,
    };
    let check = CheckInput {
        descriptors: smallvec::smallvec![DescriptorInput {
            key: input.key,
            route: input.route,
            tier: input.tier,
            cost: Some(amount),
        }],
    };
    let mut items = plan::plan_check(&check, rules, None, &ReserveNames)?;
    Ok(PlannedReserve {
        item: items.pop().expect("one descriptor"),
        ttl_ms,
    })
}

/// An `Acquire` (a concurrency lease) as a front end hands it over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcquireInput<'a> {
    /// Who is limited (1..=256 bytes).
    pub key: &'a str,
    /// `METHOD /path` or `/path`.
    pub route: &'a str,
    /// Optional tier.
    pub tier: Option<&'a str>,
    /// How long the lease lasts at most, in ms; `None`: [`DEFAULT_RESERVATION_TTL_MS`].
    pub ttl_ms: Option<i64>,
}

/// Validate an acquire and match its rule, which must declare a concurrency limit
/// (`concurrency = N`); `rules` are this node's.
pub fn plan_acquire(
    input: &AcquireInput<'_>,
    rules: &RuleSet,
) -> Result<PlannedReserve, CheckError> {
    let planned = plan_reserve(
        &ReserveInput {
            key: input.key,
            route: input.route,
            tier: input.tier,
            amount: Some(1),
            ttl_ms: input.ttl_ms,
        },
        rules,
    )?;
    if planned.item.rule.concurrency.is_none() {
        return Err(CheckError::Refused {
            field: "key".into(),
            reason: format!(
                "the rule that applies (\"{}\") declares no concurrency limit: add \
                 `concurrency = N` to it, or to a more specific rule for this key, route \
                 or tier",
                planned.item.rule.name
            ),
        });
    }
    Ok(planned)
}

/// Validate a commit: a well-formed id and an amount used.
pub fn plan_commit(input: &CommitInput<'_>) -> Result<(ReservationId, u64), CheckError> {
    let id = ReservationId::parse(input.reservation_id)
        .map_err(|reason| CheckError::invalid("reservation_id", reason))?;
    let actual = match input.actual {
        a if a < 0 => {
            return Err(CheckError::invalid(
                "actual",
                format!("must be 0 or more (got {a}): the units the work used"),
            ))
        }
        a if a > MAX_COST => {
            return Err(CheckError::invalid(
                "actual",
                format!("{a} is over the limit of {MAX_COST}"),
            ))
        }
        a => a as u64,
    };
    Ok((id, actual))
}

impl From<ReservationError> for CheckError {
    fn from(error: ReservationError) -> Self {
        match error {
            ReservationError::Full(m) => CheckError::Exhausted(m),
            // An owner's refusal arrives as it said it, field first.
            ReservationError::Refused(m) => match m.split_once(": ") {
                Some((field, reason)) if !field.contains(' ') => CheckError::Refused {
                    field: field.into(),
                    reason: reason.into(),
                },
                _ => CheckError::Refused {
                    field: "reservation_id".into(),
                    reason: m,
                },
            },
            // The owner names the field it refused, as this node's check layer would.
            ReservationError::Invalid(m) => match m.split_once(": ") {
                Some((field, reason)) => CheckError::invalid(field, reason),
                None => CheckError::invalid("request", m),
            },
            ReservationError::Unreachable(e) => CheckError::Unreachable(format!(
                "{e}; a reservation lives on its key's owner, so none was made here \
                 (one the owner made before the deadline expires at its TTL)"
            )),
            ReservationError::NoOwner => CheckError::Unreachable(error.to_string()),
            ReservationError::Shard(e) => CheckError::Shard(e),
        }
    }
}

impl Checker {
    /// Reserve units for work priced after it is done: see `docs/reservations.md`.
    pub async fn reserve(&self, input: &ReserveInput<'_>) -> Result<ReserveVerdict, CheckError> {
        let planned = plan_reserve(input, &self.rules.load())?;
        self.hold(planned, Hold::Reservation).await
    }

    /// Acquire a concurrency lease: see `docs/reservations.md`, "Concurrency limits".
    pub async fn acquire(&self, input: &AcquireInput<'_>) -> Result<ReserveVerdict, CheckError> {
        let planned = plan_acquire(input, &self.rules.load())?;
        self.hold(planned, Hold::Lease).await
    }

    /// End a lease, on its key's current owner.
    pub async fn release(&self, lease_id: &str) -> Result<CommitVerdict, CheckError> {
        let (id, _) = plan_commit(&CommitInput {
            reservation_id: lease_id,
            actual: 0,
        })
        .map_err(|e| match e {
            CheckError::InvalidArgument { reason, .. } => CheckError::invalid("lease_id", reason),
            other => other,
        })?;
        if id.hold != Hold::Lease {
            return Err(CheckError::invalid(
                "lease_id",
                "a reservation id, not a lease id: settle it with Commit",
            ));
        }
        let released = self.router.commit(&self.rules.load(), &id, 0).await;
        released.map_err(|e| match CheckError::from(e) {
            CheckError::Refused { reason, .. } => CheckError::Refused {
                field: "lease_id".into(),
                reason,
            },
            other => other,
        })
    }

    async fn hold(
        &self,
        planned: PlannedReserve,
        hold: Hold,
    ) -> Result<ReserveVerdict, CheckError> {
        let reservation = self
            .router
            .reserve(&planned.item, planned.ttl_ms, hold)
            .await?;
        let (reservation_id, expires_at) = reservation.id.unzip();
        let decided = Decided {
            descriptors: smallvec::smallvec![DescriptorOutcome {
                item: planned.item,
                answer: reservation.answer,
                refunded: false,
            }],
        };
        Ok(ReserveVerdict {
            verdict: super::verdict(decided),
            reservation_id,
            expires_at: expires_at.unwrap_or(0),
        })
    }

    /// Commit a reservation with the units its work used, on its key's current owner.
    pub async fn commit(&self, input: &CommitInput<'_>) -> Result<CommitVerdict, CheckError> {
        let (id, actual) = plan_commit(input)?;
        if id.hold != Hold::Reservation {
            return Err(CheckError::invalid(
                "reservation_id",
                "a lease id, not a reservation id: end it with Release",
            ));
        }
        Ok(self.router.commit(&self.rules.load(), &id, actual).await?)
    }
}

/// The units a settled commit left on the counter, for an answer: `(limit, remaining)`,
/// or zeros when the counter's rule is gone.
pub fn after(settled: &Settled) -> (u64, u64) {
    settled.after.map_or((0, 0), |d| (d.limit, d.remaining))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(amount: Option<i64>, ttl_ms: Option<i64>) -> ReserveInput<'a> {
        ReserveInput {
            key: "cust",
            route: "POST /v1/chat",
            tier: None,
            amount,
            ttl_ms,
        }
    }

    fn refusal(result: Result<impl std::fmt::Debug, CheckError>) -> String {
        result.unwrap_err().to_string()
    }

    #[test]
    fn a_reservation_plans_one_check_whose_cost_is_the_amount() {
        let planned = plan_reserve(&input(Some(40), None), &RuleSet::builtin()).unwrap();
        assert_eq!(planned.item.cost.get(), 40);
        assert_eq!(planned.ttl_ms, DEFAULT_RESERVATION_TTL_MS);
        assert_eq!(&*planned.item.rule.name, "default");
        let planned = plan_reserve(&input(Some(1), Some(5)), &RuleSet::builtin()).unwrap();
        assert_eq!(planned.ttl_ms, 5);
    }

    #[test]
    fn bad_reservations_are_refused_naming_the_field() {
        let rules = RuleSet::builtin();
        let cases = [
            (input(None, None), "amount: required: the units to reserve"),
            (
                input(Some(0), None),
                "amount: must be a positive integer (got 0); a cost of 0 would admit for ever and a negative one would refund",
            ),
            (input(Some(-5), None), "amount: must be a positive integer (got -5); a cost of 0 would admit for ever and a negative one would refund"),
            (input(Some(i64::MAX), None), "amount: 9223372036854775807 is over the limit of 1000000000"),
            (
                input(Some(101), None),
                "amount: cost 101 can never be admitted: rule \"default\" admits at most 100 at once",
            ),
            (input(Some(1), Some(0)), "ttl_ms: must be a positive number of milliseconds (got 0)"),
            (input(Some(1), Some(-1)), "ttl_ms: must be a positive number of milliseconds (got -1)"),
            (
                input(Some(1), Some(3_600_001)),
                "ttl_ms: 3600001 is over the limit of 3600000 (one hour)",
            ),
            (ReserveInput { key: "", ..input(Some(1), None) }, "key: must not be empty"),
            (ReserveInput { route: "nope", ..input(Some(1), None) }, ""),
            (ReserveInput { tier: Some(""), ..input(Some(1), None) }, "tier: must not be empty when set"),
        ];
        for (i, expected) in cases {
            let got = refusal(plan_reserve(&i, &rules));
            if expected.is_empty() {
                assert!(got.starts_with("route: "), "{got}");
            } else {
                assert_eq!(got, expected);
            }
        }
    }

    #[test]
    fn bad_commits_are_refused_naming_the_field() {
        let cases = [
            (
                CommitInput {
                    reservation_id: "",
                    actual: 1,
                },
                "reservation_id: must not be empty",
            ),
            (
                CommitInput {
                    reservation_id: "r1.forged",
                    actual: 1,
                },
                "reservation_id: not a reservation id this cluster made (malformed)",
            ),
        ];
        for (i, expected) in cases {
            assert_eq!(refusal(plan_commit(&i)), expected);
        }
        let id = crate::cluster::reservation::ReservationId {
            hold: crate::cluster::reservation::Hold::Reservation,
            owner: "a".into(),
            generation: 1,
            rule: "default".into(),
            ticket: crate::shard::reservations::Ticket { serial: 1, tag: 2 },
            claim: crate::shard::reservations::Claim {
                counter: crate::shard::KeyId::of("default", b"c", ""),
                fingerprint: 3,
                amount: 10,
                expires_at: 4,
            },
        }
        .encode();
        assert_eq!(
            refusal(plan_commit(&CommitInput {
                reservation_id: &id,
                actual: -1
            })),
            "actual: must be 0 or more (got -1): the units the work used"
        );
        assert_eq!(
            refusal(plan_commit(&CommitInput {
                reservation_id: &id,
                actual: MAX_COST + 1
            })),
            "actual: 1000000001 is over the limit of 1000000000"
        );
        assert_eq!(
            plan_commit(&CommitInput {
                reservation_id: &id,
                actual: 0
            })
            .unwrap()
            .1,
            0
        );
    }

    fn wild() -> impl proptest::strategy::Strategy<Value = i64> {
        use proptest::prelude::*;
        prop_oneof![
            Just(0),
            Just(-1),
            Just(i64::MIN),
            Just(i64::MAX),
            -5i64..2_000,
            any::<i64>()
        ]
    }

    proptest::proptest! {
        /// Any input is planned or refused naming one of the request's fields; never a
        /// panic, and a plan always holds a cost and TTL inside the bounds.
        #[test]
        fn any_reservation_input_is_planned_or_refused_by_field(
            key in ".{0,300}", route in ".{0,40}", tier in proptest::option::of(".{0,70}"),
            amount in proptest::option::of(wild()), ttl in proptest::option::of(wild()),
            id in ".{0,80}", actual in wild(),
        ) {
            let rules = RuleSet::builtin();
            let input = ReserveInput { key: &key, route: &route, tier: tier.as_deref(), amount, ttl_ms: ttl };
            let fields = ["key", "route", "tier", "amount", "ttl_ms", "reservation_id", "actual"];
            let by_field = |e: CheckError| match e {
                CheckError::InvalidArgument { field, .. } | CheckError::Refused { field, .. } => {
                    fields.contains(&field.as_str())
                }
                _ => false,
            };
            match plan_reserve(&input, &rules) {
                Ok(p) => {
                    proptest::prop_assert!(p.item.cost.get() <= 100);
                    proptest::prop_assert!((1..=MAX_RESERVATION_TTL_MS as u64).contains(&p.ttl_ms));
                }
                Err(e) => proptest::prop_assert!(by_field(e)),
            }
            let acquire = AcquireInput { key: &key, route: &route, tier: tier.as_deref(), ttl_ms: ttl };
            // The built-in rule declares no concurrency limit: never granted a plan.
            proptest::prop_assert!(plan_acquire(&acquire, &rules).is_err_and(by_field));
            if let Err(e) = plan_commit(&CommitInput { reservation_id: &id, actual }) {
                proptest::prop_assert!(by_field(e));
            }
        }
    }

    #[test]
    fn an_owners_refusal_keeps_its_field() {
        let e: CheckError = ReservationError::Invalid("amount: too big".into()).into();
        assert_eq!(e, CheckError::invalid("amount", "too big"));
        let e: CheckError = ReservationError::Refused("already committed".into()).into();
        assert_eq!(e.to_string(), "reservation_id: already committed");
    }
}
