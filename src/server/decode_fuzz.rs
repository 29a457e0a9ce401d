//! Decode robustness: arbitrary bytes, and arbitrary then mutated encodings of every
//! request message a node accepts (`ringlimit.v1` `CheckRequest` / `CheckBatchRequest`,
//! peer `ForwardRequest` / `RefundRequest` / `InstallRequest`), decoded with prost and,
//! where decoding succeeds, pushed through the path the adapters use: the mapping
//! functions, `plan_check` / `plan_batch` / `plan_forward` / `plan_refund`, and for
//! handed-over state `decode_install`, `handoff::with_rules` and the store's install and
//! check. Never a panic; always a plan or an `InvalidArgument` naming a field; and no
//! state that gets past validation can freeze a key for longer than its rule allows.
//! The `ringlimit.v1` requests and the peer `ForwardRequest` and `InstallRequest` are
//! decoded as the server decodes them (strings as slices of the body:
//! `ringlimit_v1::V1Request`, the hand-written `ForwardItem` and `KeyState`), and every case is also decoded by prost-derived code as
//! the reference: the same bytes accepted with the same fields, or refused with the same
//! error text.
//!
//! Fast by default (512 cases per test, under a second). A longer run, printing what
//! the cases reached (how many decoded as each message, were planned or refused, and
//! how many handed-over states were installed or refused):
//! `PROPTEST_CASES=20000 cargo test --lib server::decode_fuzz -- --nocapture`.

use std::num::NonZeroU64;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use prost::Message;

use super::peer::{decode_install, plan_forward, plan_refund};
use super::ringlimit_v1::{input, V1BatchRequest, V1Names, V1Request};
use crate::algorithms::AlgorithmKind;
use crate::check::plan::{plan_batch, plan_check};
use crate::check::CheckError;
use crate::cluster::handoff::{self, MAX_CLOCK_SKEW_MS};
use crate::config::rules::RuleSet;
use crate::proto;
use crate::proto::peer;
use crate::shard::{Counter, Store};

/// What the runs reached, printed at the end of each (`--nocapture`): a fuzz that never
/// gets past the decoder proves little.
#[derive(Debug, Default)]
struct Reached {
    decoded: [u64; 5],
    planned: u64,
    refused: u64,
    states_installed: u64,
    states_refused: u64,
}

static REACHED: std::sync::Mutex<Reached> = std::sync::Mutex::new(Reached {
    decoded: [0; 5],
    planned: 0,
    refused: 0,
    states_installed: 0,
    states_refused: 0,
});

fn note(f: impl FnOnce(&mut Reached)) {
    if let Ok(mut reached) = REACHED.lock() {
        f(&mut reached);
    }
}
/// The receiver's clock.
const NOW: u64 = 1_700_000_000_000;

/// One rule per algorithm (and both GCRA modes), every window at most an hour.
const RULES: &str = r#"
[[rule]]
name = "fixed"
route = "GET /fixed"
algorithm = "fixed_window"
limit = 20
window = "1h"

[[rule]]
name = "counter"
route = "GET /counter"
algorithm = "sliding_window_counter"
limit = 20
window = "1m"

[[rule]]
name = "log"
route = "GET /log"
algorithm = "sliding_window_log"
limit = 5
window = "1h"

[[rule]]
name = "bucket"
route = "GET /bucket"
algorithm = "token_bucket"
limit = 10
burst = 20
window = "1h"

[[rule]]
name = "meter"
route = "GET /meter"
algorithm = "leaky_bucket"
limit = 10
burst = 3
window = "1m"

[[rule]]
name = "shaper"
route = "GET /shaper"
algorithm = "leaky_bucket"
mode = "shaper"
queue_depth = 4
limit = 10
window = "1m"
"#;

/// Longest a cost-1 check may be told to wait on any state that passed validation: the
/// skew allowance plus two of the longest window (a sliding counter's previous window
/// still weighs in during the current one; a token bucket of 10 per hour refills one
/// token in 6 min).
const LONGEST_WAIT_MS: u64 = MAX_CLOCK_SKEW_MS + 2 * 3_600_000;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512)
}

/// Ok, or a refusal naming a field: nothing else is a clear answer to bad input.
fn clear<T>(what: &str, result: Result<T, CheckError>) -> Result<(), TestCaseError> {
    match result {
        Ok(_) => {
            note(|r| r.planned += 1);
            Ok(())
        }
        Err(CheckError::InvalidArgument { field, reason }) => {
            note(|r| r.refused += 1);
            prop_assert!(
                !field.is_empty(),
                "{what}: refusal without a field: {reason}"
            );
            prop_assert!(
                !reason.is_empty(),
                "{what}: refusal of {field} without a reason"
            );
            Ok(())
        }
        Err(other) => Err(TestCaseError::fail(format!(
            "{what}: not a clear refusal: {other:?}"
        ))),
    }
}

/// `bytes` decoded as the server decodes them (`L`, strings as slices
/// of the body), held to prost's decoding of the generated message `P` as the reference:
/// the same bytes are accepted with the same fields (compared as `P`'s encoding), and
/// refused with the same error text.
fn decoded_as_prost_would<
    L: Message + Default + std::fmt::Debug,
    P: Message + Default + PartialEq + std::fmt::Debug,
>(
    bytes: &[u8],
) -> Result<Result<L, prost::DecodeError>, TestCaseError> {
    let lean = L::decode(bytes::Bytes::copy_from_slice(bytes));
    match (&lean, P::decode(bytes)) {
        (Ok(lean), Ok(reference)) => {
            // Re-encoded, both are canonical: equal fields give equal bytes.
            let lean = P::decode(&lean.encode_to_vec()[..]).map_err(|e| {
                TestCaseError::fail(format!("a decoded request does not re-encode: {e}"))
            })?;
            prop_assert!(lean == reference, "fields differ from prost's");
        }
        (Err(lean), Err(reference)) => prop_assert_eq!(lean.to_string(), reference.to_string()),
        (lean, reference) => {
            return Err(TestCaseError::fail(format!(
                "accepted differently: server {lean:?}, prost {reference:?}"
            )))
        }
    }
    Ok(lean)
}

/// Decode `bytes` as every request message and push whatever decodes down the path its
/// adapter would.
fn exercise(bytes: &[u8], rules: &RuleSet) -> Result<(), TestCaseError> {
    if let Ok(request) = decoded_as_prost_would::<V1Request, proto::CheckRequest>(bytes)? {
        note(|r| r.decoded[0] += 1);
        clear("Check", plan_check(&input(&request), rules, None, &V1Names))?;
    }
    if let Ok(batch) = decoded_as_prost_would::<V1BatchRequest, proto::CheckBatchRequest>(bytes)? {
        note(|r| r.decoded[1] += 1);
        let inputs: Vec<_> = batch.checks.iter().map(input).collect();
        clear("CheckBatch", plan_batch(&inputs, rules, &V1Names))?;
    }
    if let Ok(request) =
        decoded_as_prost_would::<peer::ForwardRequest, reference::ForwardRequest>(bytes)?
    {
        note(|r| r.decoded[2] += 1);
        clear(
            "Forward",
            plan_forward(&request, rules, &Default::default(), &Default::default()),
        )?;
    }
    if let Ok(request) = peer::RefundRequest::decode(bytes) {
        note(|r| r.decoded[3] += 1);
        clear(
            "Refund",
            plan_refund(&request, rules, &Default::default(), &Default::default()),
        )?;
    }
    if let Ok(request) =
        decoded_as_prost_would::<peer::InstallRequest, reference::InstallRequest>(bytes)?
    {
        note(|r| r.decoded[4] += 1);
        install(request, rules)?;
    }
    Ok(())
}

/// The install path: decode, vet against the rule and the clock, install into a store,
/// then check every installed key once.
fn install(request: peer::InstallRequest, rules: &RuleSet) -> Result<(), TestCaseError> {
    let states = match decode_install(request.states) {
        Ok(states) => states,
        Err(refused) => return clear("Install", Err::<(), _>(refused)),
    };
    let vetted = handoff::with_rules(states, rules, NOW);
    note(|r| {
        r.states_installed += vetted.items.len() as u64;
        r.states_refused += vetted.refused_total();
    });
    let mut store = Store::new(64, 7);
    for (item, rule) in &vetted.items {
        prop_assert_eq!(
            rule.limiter
                .validate_imported(&item.state, NOW, MAX_CLOCK_SKEW_MS),
            Ok(())
        );
        store.install(item.clone(), &rule.limiter, NOW);
    }
    for (item, rule) in &vetted.items {
        let counter = Counter {
            id: item.id,
            fingerprint: item.fingerprint,
            limiter: &rule.limiter,
            local: false,
        };
        let (decision, ..) = store.check(counter, NOW, NonZeroU64::MIN);
        prop_assert!(
            decision.retry_after_ms <= LONGEST_WAIT_MS,
            "an installed state froze its key: {:?} from {:?}",
            decision,
            item.state
        );
    }
    Ok(())
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[a-z0-9_]{1,12}",
        Just("k".repeat(257)),
        Just("t".repeat(65)),
        any::<String>(),
    ]
}

fn route() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("GET /fixed".to_string()),
        Just("GET /log".to_string()),
        Just("GET /bucket".to_string()),
        Just("GET /meter".to_string()),
        Just("/x".to_string()),
        text(),
    ]
}

fn tier() -> impl Strategy<Value = Option<String>> {
    prop::option::of(text())
}

fn cost() -> impl Strategy<Value = Option<i64>> {
    prop::option::of(prop_oneof![
        Just(1i64),
        Just(0i64),
        Just(-1i64),
        Just(i64::MIN),
        Just(i64::MAX),
        1i64..30,
        any::<i64>(),
    ])
}

fn check_request() -> impl Strategy<Value = proto::CheckRequest> {
    let descriptor =
        (text(), prop::option::of(route()), tier(), cost()).prop_map(|(key, route, tier, cost)| {
            proto::Descriptor {
                key,
                route: route.unwrap_or_default(),
                tier,
                cost,
            }
        });
    (
        text(),
        route(),
        cost(),
        tier(),
        prop::collection::vec(descriptor, 0..10),
    )
        .prop_map(
            |(key, route, cost, tier, descriptors)| proto::CheckRequest {
                key,
                route,
                cost,
                tier,
                descriptors,
            },
        )
}

fn wire_cost() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), 1u64..30, Just(u64::MAX), any::<u64>()]
}

/// prost-derived `ForwardRequest` / `ForwardItem` and `InstallRequest` / `KeyState` with
/// `String`s and `Vec`s, as prost-build generated them before the item and the state
/// were hand-written (`cluster::link::item`, `cluster::link::key_state`): the reference
/// their decoding is held to, and what the fuzz encodes. The structs keep the
/// proto names, as prost's errors name them.
mod reference {
    use crate::proto::peer::NamedRule;

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ForwardItem {
        #[prost(string, tag = "1")]
        pub key: String,
        #[prost(string, tag = "2")]
        pub route: String,
        #[prost(string, optional, tag = "3")]
        pub tier: Option<String>,
        #[prost(uint64, tag = "4")]
        pub cost: u64,
        #[prost(uint32, tag = "5")]
        pub hops: u32,
        #[prost(message, optional, tag = "6")]
        pub named: Option<NamedRule>,
        #[prost(uint64, tag = "7")]
        pub give_back: u64,
        #[prost(bool, tag = "8")]
        pub drain: bool,
        #[prost(bool, tag = "9")]
        pub peek: bool,
        #[prost(fixed64, tag = "10")]
        pub rule_hash: u64,
        #[prost(bool, tag = "11")]
        pub failover: bool,
        #[prost(bool, tag = "12")]
        pub failover_in_doubt: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KeyState {
        #[prost(uint64, tag = "2")]
        pub fingerprint: u64,
        #[prost(string, tag = "3")]
        pub algorithm: String,
        #[prost(uint64, repeated, tag = "4")]
        pub words: Vec<u64>,
        #[prost(fixed64, tag = "5")]
        pub placement: u64,
        #[prost(fixed64, tag = "6")]
        pub id: u64,
        #[prost(message, optional, tag = "7")]
        pub inline: Option<crate::proto::peer::InlineRule>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct InstallRequest {
        #[prost(string, tag = "1")]
        pub from_node: String,
        #[prost(message, repeated, tag = "2")]
        pub states: Vec<KeyState>,
        #[prost(bool, tag = "3")]
        pub joined: bool,
        #[prost(uint64, tag = "4")]
        pub sender_generation: u64,
        #[prost(uint64, tag = "5")]
        pub batch: u64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ForwardRequest {
        #[prost(string, tag = "1")]
        pub from_node: String,
        #[prost(message, repeated, tag = "2")]
        pub items: Vec<ForwardItem>,
        #[prost(uint64, tag = "3")]
        pub deadline_ms: u64,
        #[prost(bool, tag = "4")]
        pub compact: bool,
    }
}

fn named_rule() -> impl Strategy<Value = Option<peer::NamedRule>> {
    let named =
        (text(), any::<u32>(), any::<u64>()).prop_map(|(name, limit, unit)| peer::NamedRule {
            name,
            override_limit: limit % 3,
            override_unit_seconds: unit % 3,
            inline: None,
        });
    prop_oneof![4 => Just(None), 1 => named.prop_map(Some)]
}

fn forward_request() -> impl Strategy<Value = reference::ForwardRequest> {
    let item = (
        (text(), route(), tier(), wire_cost(), any::<u32>()),
        (named_rule(), wire_cost(), any::<[bool; 4]>(), any::<u64>()),
    )
        .prop_map(
            |((key, route, tier, cost, hops), (named, give_back, flags, rule_hash))| {
                reference::ForwardItem {
                    key,
                    route,
                    tier,
                    cost,
                    hops,
                    named,
                    give_back,
                    drain: flags[0],
                    peek: flags[1],
                    rule_hash,
                    failover: flags[2],
                    failover_in_doubt: flags[3],
                }
            },
        );
    (
        text(),
        prop::collection::vec(item, 0..12),
        any::<u64>(),
        any::<bool>(),
    )
        .prop_map(
            |(from_node, items, deadline_ms, compact)| reference::ForwardRequest {
                from_node,
                items,
                deadline_ms,
                compact,
            },
        )
}

fn refund_request() -> impl Strategy<Value = peer::RefundRequest> {
    let item = (text(), route(), tier(), wire_cost(), any::<u64>()).prop_map(
        |(key, route, tier, cost, at)| peer::RefundItem {
            key,
            route,
            tier,
            cost,
            at,
            named: None,
        },
    );
    prop::collection::vec(item, 0..12).prop_map(|items| peer::RefundRequest { items })
}

/// Words that hit the validation's edges: near the receiver's clock, in its windows,
/// small counts, and the extremes.
fn word() -> impl Strategy<Value = u64> {
    prop_oneof![
        1 => Just(0u64),
        4 => 0u64..30,
        1 => (NOW * 10 - 1_000_000)..(NOW * 10 + 100_000),
        3 => (NOW - 120_000)..(NOW + 2 * MAX_CLOCK_SKEW_MS),
        3 => prop::sample::select(vec![
            NOW / 60_000,
            NOW / 60_000 + 1,
            NOW / 3_600_000,
            NOW / 3_600_000 + 1,
        ]),
        1 => prop::sample::select(vec![1_000_000_000_000u64, u64::MAX]),
        1 => any::<u64>(),
    ]
}

/// An instant near the receiver's clock (either side of the skew allowance), or any word.
fn instant() -> impl Strategy<Value = u64> {
    prop_oneof![4 => (NOW - 120_000)..(NOW + 2 * MAX_CLOCK_SKEW_MS), 1 => word()]
}

/// A small count (around the fuzz rules' limits), or any word.
fn count() -> impl Strategy<Value = u64> {
    prop_oneof![4 => 0u64..=21, 1 => word()]
}

/// A window index of the fuzz rules' windows around now, or any word.
fn window() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => prop::sample::select(vec![
            NOW / 60_000 - 1,
            NOW / 60_000,
            NOW / 60_000 + 1,
            NOW / 3_600_000,
            NOW / 3_600_000 + 1,
        ]),
        1 => word(),
    ]
}

/// Words laid out as a state of `algorithm`, with values near what the validation
/// decides on (a sliding log with `entries` entries).
fn shaped_words(algorithm: &str, entries: usize) -> BoxedStrategy<Vec<u64>> {
    match algorithm {
        "fixed_window" => (window(), count()).prop_map(|(a, b)| vec![a, b]).boxed(),
        "sliding_window_counter" => (window(), count(), count())
            .prop_map(|(a, b, c)| vec![a, b, c])
            .boxed(),
        "token_bucket" => (prop_oneof![4 => 0u64..=72_000_001, 1 => word()], instant())
            .prop_map(|(a, b)| vec![a, b])
            .boxed(),
        // The schedule in units of ms × limit (10 for the fuzz rules), booked up to a
        // few seconds ahead.
        "leaky_bucket" => (
            prop_oneof![4 => Just(0u64), 1 => word()],
            prop_oneof![4 => (NOW * 10 - 100_000)..(NOW * 10 + 200_000), 1 => word()],
            instant(),
        )
            .prop_map(|(a, b, c)| vec![a, b, c])
            .boxed(),
        _ => (
            instant(),
            prop::collection::vec((1u64..2_000, 1u64..=2), entries..=entries),
            any::<bool>(),
            word(),
        )
            .prop_map(|(high, gaps, honest, forged_sum)| {
                // Entries in increasing time order ending at most at `high`.
                let mut at = high.saturating_sub(gaps.iter().map(|g| g.0).sum::<u64>());
                let sum: u64 = gaps.iter().map(|g| g.1).sum();
                let mut words = vec![high, if honest { sum } else { forged_sum }];
                for (gap, cost) in gaps {
                    at = at.saturating_add(gap);
                    words.extend([at, cost]);
                }
                words
            })
            .boxed(),
    }
}

/// A rule's fingerprint, its algorithm's name and how many words its state has (the
/// sliding log's is 2 plus 2 per entry).
type RuleShape = (u64, &'static str, usize);

fn shapes(rules: &RuleSet) -> Vec<RuleShape> {
    rules
        .rules()
        .iter()
        .map(|r| {
            let words = match r.limiter.kind() {
                AlgorithmKind::SlidingWindowCounter | AlgorithmKind::LeakyBucket => 3,
                _ => 2,
            };
            (r.fingerprint, r.limiter.kind().as_str(), words)
        })
        .collect()
}

fn install_request(shapes: Vec<RuleShape>) -> impl Strategy<Value = reference::InstallRequest> {
    // Mostly states shaped for one of the rules (so they reach the validation and, when
    // plausible, the store), sometimes anything at all.
    let shaped = (prop::sample::select(shapes), 0usize..4).prop_flat_map(
        |((fingerprint, algorithm, _), entries)| {
            (
                Just(fingerprint),
                Just(algorithm.to_string()),
                shaped_words(algorithm, entries),
            )
        },
    );
    let anything = (
        any::<u64>(),
        prop_oneof![Just("fixed_window".to_string()), text()],
        prop::collection::vec(word(), 0..12),
    );
    let state = (
        prop_oneof![4 => shaped, 1 => anything],
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |((fingerprint, algorithm, words), placement, id)| reference::KeyState {
                fingerprint,
                algorithm,
                words,
                placement,
                id,
                inline: None,
            },
        );
    (
        text(),
        prop::collection::vec(state, 0..12),
        any::<bool>(),
        any::<(u64, u64)>(),
    )
        .prop_map(|(from_node, states, joined, (sender_generation, batch))| {
            reference::InstallRequest {
                from_node,
                states,
                joined,
                sender_generation,
                batch,
            }
        })
}

/// One edit of an encoding.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Insert(usize, u8),
    Remove(usize),
    Truncate(usize),
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    let one = prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(at, x)| Mutation::Flip(at, x)),
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Insert(at, b)),
        any::<usize>().prop_map(Mutation::Remove),
        any::<usize>().prop_map(Mutation::Truncate),
    ];
    prop_oneof![
        2 => Just(Vec::new()),
        1 => prop::collection::vec(one, 1..4),
    ]
}

fn mutate(mut bytes: Vec<u8>, edits: &[Mutation]) -> Vec<u8> {
    for edit in edits {
        let len = bytes.len();
        match *edit {
            Mutation::Flip(at, x) if len > 0 => bytes[at % len] ^= x,
            Mutation::Insert(at, b) => bytes.insert(at % (len + 1), b),
            Mutation::Remove(at) if len > 0 => {
                bytes.remove(at % len);
            }
            Mutation::Truncate(at) => bytes.truncate(at % (len + 1)),
            _ => {}
        }
    }
    bytes
}

/// Encodings of every request message, any of which may then be mutated.
fn encoding(shapes: Vec<RuleShape>) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        check_request().prop_map(|m| m.encode_to_vec()),
        prop::collection::vec(check_request(), 0..4)
            .prop_map(|checks| proto::CheckBatchRequest { checks }.encode_to_vec()),
        forward_request().prop_map(|m| m.encode_to_vec()),
        refund_request().prop_map(|m| m.encode_to_vec()),
        install_request(shapes).prop_map(|m| m.encode_to_vec()),
    ]
}

fn fuzz_rules() -> RuleSet {
    RuleSet::from_toml_str(RULES).unwrap()
}

/// Run `strategy` through `test` for [`cases`] cases, then print what was reached.
fn run<S: Strategy>(name: &str, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>) {
    let started = std::time::Instant::now();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: cases(),
        ..ProptestConfig::default()
    });
    if let Err(failure) = runner.run(&strategy, test) {
        panic!("{name}: {failure}");
    }
    eprintln!(
        "{name}: {} cases in {:.1?}; so far in this process {:?} (decoded: Check, CheckBatch, Forward, Refund, Install)",
        cases(),
        started.elapsed(),
        REACHED.lock().map(|r| format!("{r:?}")).unwrap_or_default()
    );
}

/// Any bytes at all, decoded as every request message.
#[test]
fn arbitrary_bytes_never_panic_and_are_answered_clearly() {
    let rules = fuzz_rules();
    run(
        "arbitrary bytes",
        prop::collection::vec(any::<u8>(), 0..512),
        |bytes| exercise(&bytes, &rules),
    );
}

/// Well-formed encodings of arbitrary (often invalid) field values, then bit flips,
/// insertions, deletions and truncations.
#[test]
fn mutated_encodings_never_panic_and_are_answered_clearly() {
    let rules = fuzz_rules();
    run(
        "mutated encodings",
        (encoding(shapes(&rules)), mutations()),
        |(bytes, edits)| exercise(&mutate(bytes, &edits), &rules),
    );
}

#[test]
fn the_fuzz_reaches_the_store_with_plausible_states_and_refuses_the_rest() {
    // Sanity for the harness itself: a plausible state does install, a far-future one does not.
    let rules = fuzz_rules();
    let fixed = rules.rules().iter().find(|r| &*r.name == "fixed").unwrap();
    let state = |words: Vec<u64>| peer::KeyState {
        fingerprint: fixed.fingerprint,
        algorithm: "fixed_window".into(),
        words: words.into(),
        placement: 1,
        id: 2,
        inline: None,
    };
    let decoded = decode_install(vec![
        state(vec![NOW / 3_600_000, 20]),
        state(vec![1_000_000_000_000, 20]),
    ])
    .unwrap();
    let vetted = handoff::with_rules(decoded, &rules, NOW);
    assert_eq!(vetted.items.len(), 1);
    assert_eq!(vetted.refused_total(), 1);
    assert!(install(
        peer::InstallRequest {
            from_node: "x".into(),
            states: vec![state(vec![1_000_000_000_000, 20])],
            joined: false,
            sender_generation: 0,
            batch: 0,
        },
        &rules
    )
    .is_ok());
}
