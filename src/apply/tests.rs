//! Batch admission and the per-order path decide alike: a property test over real SQLite.
//!
//! Two fresh databases, migrated with every `migrations/sqlite/*.sql`, get the same tenants and
//! resources and then the same random sequence of operations: orders, confirms, releases,
//! expiries, adjustments and status changes. On database A every order goes through
//! [`orders::execute`] on its own, and every confirm or release through
//! [`reservations::execute`]. On database B each maximal run of consecutive orders, confirms
//! and releases is cut into groups of random size, and each group is committed the way the
//! SQLite writer (`storage::sqlite::writer::commit_batch`) commits a batch: `BEGIN IMMEDIATE`,
//! the group's orders and moves decided together by [`batch::admit`] in a savepoint (on the
//! reservations [`batch::read_moves`] reads and the rows `SqlitePort::admission_rows` reads),
//! then every order and move admission left undecided on its own in its own savepoint, then
//! `COMMIT`. Other operations run between groups, each in a transaction of its own on both
//! databases.
//!
//! The order in which the orders of a group take effect on B is not the order they came in:
//! admission decides the orders it can in batch order, and those it leaves (limits, creation, a
//! key used twice in the batch) run after all of those. So an order admission decides takes
//! stock, or an idempotency key, before one that came earlier in the batch but was left to the
//! per-order path (which then sees less stock, or a replay or mismatch). Requests of one batch
//! are concurrent, so either order is a correct outcome, but A can only agree with B if it runs
//! the orders in B's *effective* order: the test takes that order from B's writer (admitted ones
//! in batch order, then the rest in batch order) and runs A in it. (In arrival order the two
//! differ at once: a batch of two orders on one key, the first with a per-user limit.)
//!
//! Admission decides a group's orders first and its moves after them, so the effective order is:
//! admitted orders, admitted moves, then the orders and the moves left, each in batch order.
//!
//! After every order and move both paths must give the same answer (status, response body, line
//! results; a move's transition), after every step the same resource rows (stock band included),
//! and at the end the same ledger (in `seq` order), reservations, per-user limits, idempotency
//! records and events (each tenant's, in sequence order). Generated ids (`req_<ULID>`,
//! `rsv_<ULID>`) are renamed to placeholders in order of first appearance on each database;
//! times are compared exactly, because every step is given its `now` (a resource row's
//! `updated_at` too: the batch stamps each row with the time of the order that last changed it,
//! as the per-order path does).

use std::cell::Cell;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::Path;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use rusqlite::types::Value;
use rusqlite::{params, Connection};

use super::port::run_now;
use super::{batch, orders, reservations, resources};
use crate::engine::order::OrderLineBody;
use crate::engine::{
    Action, IdempotencyKey, Kind, LimitSpec, OrderId, OrderRequest, PartialPolicy, Plan, PlannedLine, PlannerRef,
    Quantity, ReservationState, ResourceKey, ResourceStatus, Target, TenantId,
};
use crate::storage::sqlite::port::SqlitePort;
use crate::storage::{IdempotencyRequest, Idempotent, NewResource, OrderExecution, OrderJob, StorageError, Transition};

/// Keys a tenant's resources are created under.
const RESOURCE_KEYS: [&str; 4] = ["a", "b", "c", "d"];
/// Keys a plan may target: the resource keys, and one no tenant has unless an order creates it.
const TARGET_KEYS: [&str; 5] = ["a", "b", "c", "d", "x"];
/// Idempotency keys are drawn from `k0..k{KEY_POOL}`, shared by orders and adjustments, so keys
/// repeat with the same body (replays) and with another (mismatches).
const KEY_POOL: usize = 10;
/// The first step's time; each step is 1 ms after the one before (an expiry jumps further).
const START_MS: i64 = 1_700_000_000_000;
/// Expiries sweep everything due: with a smaller limit, which reservations a sweep takes among
/// those due at once would depend on their random ids.
const EXPIRE_LIMIT: u32 = 1_000;

#[derive(Debug, Clone)]
struct ResourceSpec {
    kind: Kind,
    total: i64,
    active: bool,
    buckets: i64,
}

#[derive(Debug, Clone)]
struct TargetSpec {
    /// Index into [`TARGET_KEYS`].
    key: usize,
    kind: Option<Kind>,
    create: Option<i64>,
    /// The buckets the plan prefers (every bucketed resource has buckets 0 and 1).
    buckets: Vec<u16>,
}

#[derive(Debug, Clone)]
struct LineSpec {
    qty: i64,
    mandatory: bool,
    targets: Vec<TargetSpec>,
    /// Per-user limit `user{n}` with its max.
    limit: Option<(usize, i64)>,
}

/// What the request hash covers: everything but the tenant and the key.
#[derive(Debug, Clone)]
struct BodySpec {
    order_id: usize,
    action: Action,
    policy: PartialPolicy,
    /// Planned by a (pretend) tenant plugin rather than the built-in planner.
    plugin: bool,
    lines: Vec<LineSpec>,
}

#[derive(Debug, Clone)]
struct OrderSpec {
    /// Taken modulo the number of tenants.
    tenant: usize,
    idem: usize,
    body: BodySpec,
}

#[derive(Debug, Clone)]
enum Op {
    Order(OrderSpec),
    /// An earlier order (its index among them, modulo their number) sent again as it was.
    Replay(usize),
    /// The reservation with this index (modulo their number) among those made so far.
    Confirm(usize),
    Release(usize),
    Expire {
        jump: i64,
    },
    Adjust {
        tenant: usize,
        key: usize,
        delta: i64,
        idem: usize,
    },
    SetStatus {
        tenant: usize,
        key: usize,
        active: bool,
    },
}

#[derive(Debug, Clone)]
struct Scenario {
    /// Per tenant, per [`RESOURCE_KEYS`] entry: the resource, if the tenant has it.
    tenants: Vec<Vec<Option<ResourceSpec>>>,
    /// Every reservation's lifetime. One per scenario: with every step at its own time, no two
    /// reservations then expire at the same instant, so an expiry sweep takes them in one order.
    ttl_ms: i64,
    ops: Vec<Op>,
    /// Group sizes for B, used in turn (cyclically) across all runs of orders.
    groups: Vec<usize>,
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![Just(Kind::Inventory), Just(Kind::Quota)]
}

fn resource_spec() -> impl Strategy<Value = ResourceSpec> {
    let buckets = prop_oneof![3 => Just(1i64), 2 => 2i64..=3];
    (kind(), 0i64..20, prop::bool::weighted(0.8), buckets).prop_map(|(kind, total, active, buckets)| ResourceSpec {
        kind,
        total,
        active,
        buckets,
    })
}

fn target_spec() -> impl Strategy<Value = TargetSpec> {
    (
        0..TARGET_KEYS.len(),
        prop::option::weighted(0.25, kind()),
        prop::option::weighted(0.05, 0i64..10),
        prop::collection::vec(0u16..2, 0..=2),
    )
        .prop_map(|(key, kind, create, buckets)| TargetSpec { key, kind, create, buckets })
}

fn line_spec() -> impl Strategy<Value = LineSpec> {
    (
        1i64..=6,
        any::<bool>(),
        prop::collection::vec(target_spec(), 1..=2),
        prop::option::weighted(0.1, (0..2usize, 1i64..8)),
    )
        .prop_map(|(qty, mandatory, targets, limit)| LineSpec { qty, mandatory, targets, limit })
}

fn order_spec() -> impl Strategy<Value = OrderSpec> {
    let action = prop_oneof![Just(Action::Deduct), Just(Action::Reserve)];
    let policy = prop_oneof![
        Just(PartialPolicy::AllOrNothing),
        Just(PartialPolicy::AllowPartial),
        Just(PartialPolicy::MandatoryLines)
    ];
    (
        0..2usize,
        0..KEY_POOL,
        0..4usize,
        action,
        policy,
        prop::bool::weighted(0.3),
        prop::collection::vec(line_spec(), 1..=3),
        Just((0..TARGET_KEYS.len()).collect::<Vec<_>>()).prop_shuffle(),
    )
        .prop_map(|(tenant, idem, order_id, action, policy, plugin, mut lines, keys)| {
            // A plan targets each resource at most once (`plugin::registry::to_plan` refuses
            // others: the ledger's identity is one change per resource, request and op), so the
            // targets take distinct keys, in turn from a shuffle; what is left without one goes.
            let mut keys = keys.into_iter();
            for line in &mut lines {
                line.targets.retain_mut(|target| keys.next().map(|key| target.key = key).is_some());
            }
            lines.retain(|line| !line.targets.is_empty());
            OrderSpec { tenant, idem, body: BodySpec { order_id, action, policy, plugin, lines } }
        })
}

fn order_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => order_spec().prop_map(Op::Order),
        2 => (0..64usize).prop_map(Op::Replay),
        3 => (0..16usize).prop_map(Op::Confirm),
        2 => (0..16usize).prop_map(Op::Release),
    ]
}

fn other_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..16usize).prop_map(Op::Confirm),
        2 => (0..16usize).prop_map(Op::Release),
        1 => (0i64..40).prop_map(|jump| Op::Expire { jump }),
        3 => (0..2usize, 0..TARGET_KEYS.len(), prop_oneof![-8i64..=-1, 1i64..=8], 0..KEY_POOL)
            .prop_map(|(tenant, key, delta, idem)| Op::Adjust { tenant, key, delta, idem }),
        1 => (0..2usize, 0..RESOURCE_KEYS.len(), any::<bool>())
            .prop_map(|(tenant, key, active)| Op::SetStatus { tenant, key, active }),
    ]
}

fn scenario() -> impl Strategy<Value = Scenario> {
    // Bursts of orders (what batches are made of) between single other operations.
    let segment = prop_oneof![
        3 => prop::collection::vec(order_op(), 1..12),
        2 => other_op().prop_map(|op| vec![op]),
    ];
    (
        prop::collection::vec(
            prop::collection::vec(prop::option::weighted(0.85, resource_spec()), RESOURCE_KEYS.len()),
            1..=2,
        ),
        1i64..=30,
        prop::collection::vec(segment, 1..8).prop_map(|segments| segments.concat()),
        prop::collection::vec(1usize..=8, 1..12),
    )
        .prop_map(|(tenants, ttl_ms, ops, groups)| Scenario { tenants, ttl_ms, ops, groups })
}

fn key(text: &str) -> ResourceKey {
    ResourceKey::parse(text).expect("a valid resource key")
}

fn tenant_id(index: usize, tenants: usize) -> TenantId {
    TenantId::parse(format!("t{}", index % tenants)).expect("a valid tenant id")
}

fn idempotency(idem: usize, body: &str) -> IdempotencyRequest {
    let mut hasher = DefaultHasher::new();
    body.hash(&mut hasher);
    IdempotencyRequest {
        key: IdempotencyKey::parse(format!("k{idem}")).expect("a valid idempotency key"),
        request_hash: format!("{:016x}", hasher.finish()),
    }
}

/// The order and its plan, built directly (no planner).
fn order_job(spec: &OrderSpec, tenants: usize, ttl_ms: i64) -> OrderJob {
    let body = &spec.body;
    let lines = body
        .lines
        .iter()
        .enumerate()
        .map(|(i, l)| OrderLineBody {
            key: key(&format!("line{i}")),
            qty: Quantity::new(l.qty).expect("a valid quantity"),
            attributes: None,
        })
        .collect();
    let planned = body
        .lines
        .iter()
        .enumerate()
        .map(|(i, l)| PlannedLine {
            line: i,
            qty: l.qty,
            mandatory: l.mandatory,
            targets: l
                .targets
                .iter()
                .map(|t| Target {
                    resource: key(TARGET_KEYS[t.key]),
                    kind: t.kind,
                    create_if_missing: t.create,
                    buckets: t.buckets.clone(),
                })
                .collect(),
            limit: l.limit.map(|(user, max)| LimitSpec { key: key(&format!("user{user}")), max }),
        })
        .collect();
    let planner =
        if body.plugin { PlannerRef { name: "tenant-plugin".into(), version: 7 } } else { PlannerRef::builtin() };
    OrderJob {
        tenant: tenant_id(spec.tenant, tenants),
        idempotency: idempotency(spec.idem, &format!("order {body:?}")),
        order: OrderRequest {
            // Named like keys, so that some orders are sent with their own id as their key
            // (found through the key's record on SQLite: migrations/sqlite/0022).
            order_id: OrderId::parse(format!("k{}", body.order_id)).expect("a valid order id"),
            user_id: None,
            action: body.action,
            ttl_seconds: None,
            lines,
        },
        plan: Plan { planner, policy: body.policy, lines: planned },
        ttl_ms,
    }
}

/// Renames generated ids (`req_<ULID>`, `rsv_<ULID>`) to `req_<n>` / `rsv_<n>`, numbered per
/// prefix in order of first appearance.
#[derive(Default)]
struct Ids {
    names: HashMap<String, String>,
    counts: HashMap<&'static str, usize>,
}

impl Ids {
    fn text(&mut self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut i = 0;
        while i < text.len() {
            let rest = &text[i..];
            let id = ["rsv_", "req_"].into_iter().find_map(|prefix| {
                let ulid = rest.strip_prefix(prefix)?.get(..26)?;
                ulid.bytes().all(|b| b.is_ascii_digit() || b.is_ascii_uppercase()).then_some(prefix)
            });
            if let Some(prefix) = id {
                let end = prefix.len() + 26;
                let name = match self.names.get(&rest[..end]) {
                    Some(name) => name.clone(),
                    None => {
                        let count = self.counts.entry(prefix).or_default();
                        let name = format!("{prefix}<{count}>");
                        *count += 1;
                        self.names.insert(rest[..end].to_string(), name.clone());
                        name
                    }
                };
                out.push_str(&name);
                i += end;
            } else {
                let c = rest.chars().next().expect("a character at a boundary");
                out.push(c);
                i += c.len_utf8();
            }
        }
        out
    }

    fn debug(&mut self, value: &impl std::fmt::Debug) -> String {
        self.text(&format!("{value:?}"))
    }
}

/// One write of a group: an order, or a confirm or release of a reservation made before the
/// group (the same one on both databases, each under its own id).
enum Item {
    Order(OrderJob),
    Move { a: batch::MoveJob, b: batch::MoveJob },
}

/// What one write of a group answered.
enum Answer {
    Order(Result<OrderExecution, StorageError>),
    Move(Result<Transition, StorageError>),
}

/// How one group fared on B.
struct Decided {
    /// Each write's index in the group and its answer, in the order they took effect.
    effective: Vec<(usize, Answer)>,
    /// Admission itself failed (the writer would then run every order on its own).
    admission_error: Option<StorageError>,
    /// Decided by admission: applied or refused now, and answered from an earlier outcome.
    admitted: usize,
    answered: usize,
    /// Moves decided by admission.
    moved: usize,
    /// Left to the per-order path by admission (in groups of two or more).
    left: usize,
    /// Admitted orders that took from a bucketed resource, and admitted moves of reservations
    /// that did.
    bucketed: usize,
    bucketed_moves: usize,
}

/// How often each path was taken, over every case; the test fails if admission or the mixed
/// path was never exercised.
#[derive(Default)]
struct Stats {
    groups: Cell<usize>,
    admitted: Cell<usize>,
    answered: Cell<usize>,
    moved: Cell<usize>,
    left: Cell<usize>,
    /// Groups where admission decided some orders and left others.
    mixed: Cell<usize>,
    /// Orders admission applied that took from a bucketed resource, and moves it made of
    /// reservations that did.
    bucketed: Cell<usize>,
    bucketed_moves: Cell<usize>,
}

fn bump(cell: &Cell<usize>, by: usize) {
    cell.set(cell.get() + by);
}

fn exec(conn: &Connection, sql: &str) -> rusqlite::Result<usize> {
    conn.prepare_cached(sql)?.execute([])
}

/// A job in its own savepoint, rolled back alone when it fails, as the writer runs each job.
pub(super) fn in_savepoint<T>(
    conn: &Connection,
    work: impl FnOnce(&Connection) -> Result<T, StorageError>,
) -> Result<T, StorageError> {
    exec(conn, "SAVEPOINT job").expect("SAVEPOINT job");
    let result = work(conn);
    let end = if result.is_ok() {
        exec(conn, "RELEASE job")
    } else {
        exec(conn, "ROLLBACK TO job").and_then(|_| exec(conn, "RELEASE job"))
    };
    end.expect("closing the job savepoint");
    result
}

fn execute(conn: &Connection, job: &OrderJob, now_ms: i64) -> Result<OrderExecution, StorageError> {
    run_now(orders::execute(&mut SqlitePort::new(conn), job, now_ms))
}

pub(super) struct Db {
    conn: Connection,
    ids: Ids,
    /// Every reservation an order made, in the order they were made.
    reservations: Vec<(TenantId, String)>,
}

impl Db {
    /// Opened as `storage::sqlite::open_writer` opens the writer's connection (with
    /// `synchronous = NORMAL`, a setting the server allows, so the test does not wait on
    /// fsyncs), and migrated.
    pub(super) fn open(path: &Path) -> Self {
        let conn = Connection::open(path).expect("open the database");
        conn.pragma_update(None, "journal_mode", "WAL").expect("journal_mode");
        conn.pragma_update(None, "synchronous", "NORMAL").expect("synchronous");
        conn.pragma_update(None, "foreign_keys", "ON").expect("foreign_keys");
        conn.pragma_update(None, "temp_store", "MEMORY").expect("temp_store");
        conn.set_prepared_statement_cache_capacity(64);
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/sqlite");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .expect("the migrations directory")
            .map(|entry| entry.expect("a migration").path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "sql"))
            .collect();
        files.sort();
        assert!(!files.is_empty(), "no migrations in {}", dir.display());
        for file in files {
            let sql = std::fs::read_to_string(&file).expect("a readable migration");
            conn.execute_batch(&sql).unwrap_or_else(|e| panic!("migration {}: {e}", file.display()));
        }
        Self { conn, ids: Ids::default(), reservations: Vec::new() }
    }

    /// One commit of the writer around `body`.
    pub(super) fn commit<T>(&self, body: impl FnOnce(&Connection) -> T) -> T {
        self.conn.execute_batch("BEGIN IMMEDIATE").expect("BEGIN IMMEDIATE");
        let out = body(&self.conn);
        self.conn.execute_batch("COMMIT").expect("COMMIT");
        out
    }

    /// A non-order write, committed alone as the writer commits a submitted job.
    pub(super) fn work<T>(&self, work: impl FnOnce(&Connection) -> Result<T, StorageError>) -> Result<T, StorageError> {
        self.commit(|conn| in_savepoint(conn, work))
    }

    fn setup(&self, tenants: &[Vec<Option<ResourceSpec>>], now_ms: i64) {
        self.commit(|conn| {
            for (t, specs) in tenants.iter().enumerate() {
                let tenant = tenant_id(t, tenants.len());
                conn.execute(
                    "INSERT INTO tenants (id, name, created_at) VALUES (?1, ?1, ?2)",
                    params![tenant.as_str(), now_ms],
                )
                .expect("insert a tenant");
                for (k, spec) in specs.iter().enumerate() {
                    let Some(spec) = spec else { continue };
                    let new = NewResource {
                        key: key(RESOURCE_KEYS[k]),
                        kind: spec.kind,
                        total: spec.total,
                        buckets: spec.buckets,
                        low_stock: None,
                    };
                    let mut port = SqlitePort::new(conn);
                    let created = run_now(resources::create(&mut port, &tenant, &new, None, now_ms));
                    assert!(matches!(created, Ok(Some(_))), "creating {}: {created:?}", new.key);
                    if !spec.active {
                        let status = run_now(resources::set_status(
                            &mut port,
                            &tenant,
                            &new.key,
                            ResourceStatus::Inactive,
                            now_ms,
                        ));
                        assert!(matches!(status, Ok(Some(_))), "deactivating {}: {status:?}", new.key);
                    }
                }
            }
        });
    }

    /// An order on its own (A): committed alone, as the writer commits a batch of one.
    fn alone(&self, job: &OrderJob, now_ms: i64) -> Result<OrderExecution, StorageError> {
        self.commit(|conn| in_savepoint(conn, |conn| execute(conn, job, now_ms)))
    }

    /// A group of orders and moves committed together (B), exactly as `writer::commit_batch` and
    /// `writer::admit` do it.
    fn batched(&self, group: &[(Item, i64)]) -> Decided {
        self.commit(|conn| {
            let mut decided = Decided {
                effective: Vec::new(),
                admission_error: None,
                admitted: 0,
                answered: 0,
                moved: 0,
                left: 0,
                bucketed: 0,
                bucketed_moves: 0,
            };
            let orders: Vec<usize> = (0..group.len()).filter(|&i| matches!(group[i].0, Item::Order(_))).collect();
            let moves: Vec<usize> = (0..group.len()).filter(|&i| matches!(group[i].0, Item::Move { .. })).collect();
            let order = |i: usize| match &group[i].0 {
                Item::Order(job) => Some(job),
                Item::Move { .. } => None,
            };
            let moving = |i: usize| match &group[i].0 {
                Item::Move { b, .. } => Some(b),
                Item::Order(_) => None,
            };
            let (mut rest_orders, mut rest_moves) = (Vec::new(), Vec::new());
            if group.len() < 2 {
                rest_orders.clone_from(&orders);
                rest_moves.clone_from(&moves);
            } else {
                exec(conn, "SAVEPOINT orders").expect("SAVEPOINT orders");
                let jobs: Vec<(&OrderJob, i64)> =
                    orders.iter().filter_map(|&i| order(i).map(|job| (job, group[i].1))).collect();
                let moved: Vec<(&batch::MoveJob, i64)> =
                    moves.iter().filter_map(|&i| moving(i).map(|job| (job, group[i].1))).collect();
                let mut port = SqlitePort::new(conn);
                let admitted = run_now(batch::read_moves(&mut port, &moved)).and_then(|found| {
                    let wanted = jobs
                        .iter()
                        .flat_map(|(job, _)| job.plan.resources().map(|key| (job.tenant.as_str(), key.as_str())))
                        .chain(batch::move_resources(&moved, &found));
                    let rows = port.admission_rows(wanted)?;
                    run_now(batch::admit(&mut port, &jobs, &moved, found, rows))
                });
                let closed = match &admitted {
                    Ok(_) => exec(conn, "RELEASE orders"),
                    Err(_) => exec(conn, "ROLLBACK TO orders").and_then(|_| exec(conn, "RELEASE orders")),
                };
                closed.expect("closing the orders savepoint");
                let outcomes = admitted.unwrap_or_else(|err| {
                    decided.admission_error = Some(err);
                    batch::Decided::default()
                });
                let mut executions = outcomes.orders.into_iter();
                for &i in &orders {
                    match executions.next().flatten() {
                        Some(execution) => {
                            if let Some((_, results)) = &execution.outcome {
                                decided.admitted += 1;
                                if order(i).is_some_and(|job| took_from_buckets(conn, job, results)) {
                                    decided.bucketed += 1;
                                }
                            } else {
                                decided.answered += 1;
                            }
                            decided.effective.push((i, Answer::Order(Ok(execution))));
                        }
                        None => {
                            decided.left += 1;
                            rest_orders.push(i);
                        }
                    }
                }
                let mut transitions = outcomes.moves.into_iter();
                for &i in &moves {
                    match transitions.next().flatten() {
                        Some(transition) => {
                            decided.moved += 1;
                            if moving(i).is_some_and(|job| held_buckets(conn, job)) {
                                decided.bucketed_moves += 1;
                            }
                            decided.effective.push((i, Answer::Move(Ok(transition))));
                        }
                        None => {
                            decided.left += 1;
                            rest_moves.push(i);
                        }
                    }
                }
            }
            for i in rest_orders {
                let (Some(job), now_ms) = (order(i), group[i].1) else { continue };
                decided.effective.push((i, Answer::Order(in_savepoint(conn, |conn| execute(conn, job, now_ms)))));
            }
            for i in rest_moves {
                let (Some(job), now_ms) = (moving(i), group[i].1) else { continue };
                let moved =
                    in_savepoint(conn, |conn| run_now(reservations::execute(&mut SqlitePort::new(conn), job, now_ms)));
                decided.effective.push((i, Answer::Move(moved)));
            }
            decided
        })
    }

    /// Remembers the reservation a fresh order made, for later confirms and releases.
    fn note_reservation(&mut self, job: &OrderJob, result: &Result<OrderExecution, StorageError>) {
        let Ok(OrderExecution { response: Idempotent::Fresh(response), .. }) = result else { return };
        let body: serde_json::Value = serde_json::from_str(&response.body).expect("an order document");
        if let Some(id) = body.get("reservation_id").and_then(serde_json::Value::as_str) {
            self.reservations.push((job.tenant.clone(), id.to_string()));
        }
    }

    /// Every row `sql` selects, normalized, as text.
    pub(super) fn rows(&mut self, sql: &str) -> Vec<String> {
        let mut statement = self.conn.prepare(sql).expect("a valid query");
        let columns = statement.column_count();
        let rows: Vec<Vec<Value>> = statement
            .query_map([], |row| (0..columns).map(|i| row.get::<_, Value>(i).map(unpacked)).collect())
            .expect("a query")
            .collect::<rusqlite::Result<_>>()
            .expect("rows");
        rows.iter().map(|row| self.ids.debug(row)).collect()
    }
}

/// A stored payload as the JSON it holds (its ids then normalized like every other column's).
fn unpacked(value: Value) -> Value {
    match value {
        Value::Text(text) => Value::Text(crate::storage::payload::unpack(text).expect("a stored payload")),
        other => other,
    }
}

pub(super) const RESOURCES: &str =
    "SELECT tenant_id, key, kind, status, mode, buckets, total, available, reserved, consumed,
        version, updated_at, stock FROM resources ORDER BY tenant_id, key";
pub(super) const LEDGER: &str = "SELECT tenant_id, resource_key, bucket, op, qty, request_id, order_id, reservation_id,
        available_after, reserved_after, consumed_after, version_after, plugin_version, at, line_key, limit_key,
        by_key FROM ledger ORDER BY seq";
pub(super) const EVENTS: &str =
    "SELECT tenant_id, seq, type, ordering_key, at, data FROM events ORDER BY tenant_id, seq";
const RESERVATIONS: &str =
    "SELECT tenant_id, id, order_id, state, lines, expires_at, created_at, updated_at FROM reservations";
pub(super) const USER_LIMITS: &str = "SELECT tenant_id, key, used FROM user_limits ORDER BY tenant_id, key";
/// The answer as a replay reads it, and where it is kept (inline, or in the order's event).
pub(super) const IDEMPOTENCY: &str = "SELECT i.tenant_id, i.key, i.request_hash, i.response_code, i.response_type,
        COALESCE(i.response_body, e.data), i.response_event IS NULL, i.created_at,
        (SELECT f.request_id FROM ledger f WHERE f.seq = i.ledger_seq) AS found_by_key
        FROM idempotency i LEFT JOIN events e ON e.id = i.response_event ORDER BY i.tenant_id, i.key";
const BUCKETS: &str =
    "SELECT tenant_id, resource_key, bucket, total, available, reserved, consumed, version, updated_at
        FROM resource_buckets ORDER BY 1, 2, 3";

/// The first row where two dumps differ, if any.
pub(super) fn same_rows(what: &str, a: &[String], b: &[String]) -> Result<(), TestCaseError> {
    match (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)) {
        None => Ok(()),
        Some(i) => Err(TestCaseError::fail(format!(
            "{what} differ at row {i} (of {} per order, {} batched):\n  per order: {:?}\n  batched:   {:?}",
            a.len(),
            b.len(),
            a.get(i),
            b.get(i)
        ))),
    }
}

fn same_resources(a: &mut Db, b: &mut Db, after: &str) -> Result<(), TestCaseError> {
    same_rows(&format!("resources after {after}"), &a.rows(RESOURCES), &b.rows(RESOURCES))?;
    same_rows(&format!("bucket rows after {after}"), &a.rows(BUCKETS), &b.rows(BUCKETS))
}

/// An order's answer as text, its ids normalized.
fn answer(ids: &mut Ids, result: &Result<OrderExecution, StorageError>) -> String {
    let text = match result {
        Ok(OrderExecution { response, outcome }) => {
            let response = match response {
                Idempotent::Fresh(r) => format!("fresh {} {:?} {}", r.status, r.content_type, r.body),
                Idempotent::Replayed(r) => format!("replayed {} {:?} {}", r.status, r.content_type, r.body),
                Idempotent::Mismatch => "mismatch".to_string(),
            };
            format!("{response}; outcome {outcome:?}")
        }
        Err(err) => format!("Err({err:?})"),
    };
    ids.text(&text)
}

/// Whether an order applied a line to a bucketed resource.
fn took_from_buckets(conn: &Connection, job: &OrderJob, results: &[crate::engine::LineResult]) -> bool {
    job.plan.lines.iter().zip(results).any(|(line, result)| match result {
        crate::engine::LineResult::Applied(t) => line.targets.get(*t).is_some_and(|target| {
            conn.query_row(
                "SELECT buckets FROM resources WHERE tenant_id = ?1 AND key = ?2",
                params![job.tenant.as_str(), target.resource.as_str()],
                |row| row.get::<_, i64>(0),
            )
            .is_ok_and(|n| n > 1)
        }),
        crate::engine::LineResult::Rejected(_) => false,
    })
}

/// Whether a move's reservation holds stock in buckets.
fn held_buckets(conn: &Connection, job: &batch::MoveJob) -> bool {
    conn.query_row(
        "SELECT lines FROM reservations WHERE tenant_id = ?1 AND id = ?2",
        params![job.tenant.as_str(), job.id],
        |row| row.get::<_, String>(0),
    )
    .is_ok_and(|lines| lines.contains("\"buckets\""))
}

/// `available + reserved + consumed == total`, none negative.
fn balanced(db: &Db, name: &str) -> Result<(), TestCaseError> {
    let mut statement = db
        .conn
        .prepare("SELECT tenant_id, key, available, reserved, consumed, total FROM resources")
        .expect("a valid query");
    let rows: Vec<(String, String, i64, i64, i64, i64)> = statement
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)))
        .expect("a query")
        .collect::<rusqlite::Result<_>>()
        .expect("rows");
    for (tenant, key, available, reserved, consumed, total) in rows {
        prop_assert!(
            available >= 0 && reserved >= 0 && consumed >= 0 && available + reserved + consumed == total,
            "{name}: {tenant}/{key} unbalanced: {available} + {reserved} + {consumed} != {total}"
        );
    }
    Ok(())
}

/// The steps, with each replay resolved to the order it repeats.
enum Step<'s> {
    Order(&'s OrderSpec),
    /// A confirm (`true`) or release of the reservation with this index (modulo their number).
    Move(bool, usize),
    Other(&'s Op),
}

fn steps(ops: &[Op]) -> Vec<Step<'_>> {
    let mut sent: Vec<&OrderSpec> = Vec::new();
    let mut steps = Vec::with_capacity(ops.len());
    for op in ops {
        match op {
            Op::Order(spec) => {
                sent.push(spec);
                steps.push(Step::Order(spec));
            }
            Op::Replay(n) if !sent.is_empty() => steps.push(Step::Order(sent[n % sent.len()])),
            Op::Replay(_) => {}
            Op::Confirm(n) => steps.push(Step::Move(true, *n)),
            Op::Release(n) => steps.push(Step::Move(false, *n)),
            other => steps.push(Step::Other(other)),
        }
    }
    steps
}

/// A non-order operation on both databases, compared.
fn other(a: &mut Db, b: &mut Db, op: &Op, tenants: usize, now_ms: &mut i64) -> Result<(), TestCaseError> {
    let now = *now_ms;
    let (ra, rb) = match *op {
        Op::Expire { jump } => {
            *now_ms += jump;
            let now = *now_ms;
            let expire = |db: &Db| {
                db.work(|conn| run_now(reservations::expire_due(&mut SqlitePort::new(conn), now, EXPIRE_LIMIT)))
            };
            let (ra, rb) = (expire(a), expire(b));
            (a.ids.debug(&ra), b.ids.debug(&rb))
        }
        Op::Adjust { tenant, key: k, delta, idem } => {
            let tenant = tenant_id(tenant, tenants);
            let resource = key(TARGET_KEYS[k]);
            let request = idempotency(idem, &format!("adjust {resource} {delta}"));
            let adjust = |db: &Db| {
                db.work(|conn| {
                    run_now(resources::adjust(
                        &mut SqlitePort::new(conn),
                        &tenant,
                        &request,
                        &resource,
                        delta,
                        crate::storage::ModeFence::Db,
                        now,
                    ))
                })
            };
            let (ra, rb) = (adjust(a), adjust(b));
            (a.ids.debug(&ra), b.ids.debug(&rb))
        }
        Op::SetStatus { tenant, key: k, active } => {
            let tenant = tenant_id(tenant, tenants);
            let resource = key(RESOURCE_KEYS[k]);
            let status = if active { ResourceStatus::Active } else { ResourceStatus::Inactive };
            let set = |db: &Db| {
                db.work(|conn| {
                    run_now(resources::set_status(&mut SqlitePort::new(conn), &tenant, &resource, status, now))
                })
            };
            let (ra, rb) = (set(a), set(b));
            (a.ids.debug(&ra), b.ids.debug(&rb))
        }
        // Run with the orders (see `run`).
        Op::Order(_) | Op::Replay(_) | Op::Confirm(_) | Op::Release(_) => return Ok(()),
    };
    prop_assert!(!ra.starts_with("Err"), "{:?} failed: {}", op, ra);
    prop_assert_eq!(ra, rb, "{:?} answered differently", op);
    same_resources(a, b, &format!("{op:?}"))
}

/// Runs one scenario on both databases; see the module docs.
fn run(scenario: &Scenario, stats: &Stats) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut a = Db::open(&dir.path().join("per-order.db"));
    let mut b = Db::open(&dir.path().join("batched.db"));
    let tenants = scenario.tenants.len();
    let mut now_ms = START_MS;
    a.setup(&scenario.tenants, now_ms);
    b.setup(&scenario.tenants, now_ms);
    same_resources(&mut a, &mut b, "setup")?;

    let steps = steps(&scenario.ops);
    let mut sizes = scenario.groups.iter().copied().cycle();
    let mut i = 0;
    while i < steps.len() {
        let writes = steps[i..].iter().take_while(|step| !matches!(step, Step::Other(_))).count();
        if writes == 0 {
            if let Step::Other(op) = &steps[i] {
                now_ms += 1;
                other(&mut a, &mut b, op, tenants, &mut now_ms)?;
            }
            i += 1;
            continue;
        }
        // Every write at its own time, as requests arrive; a move names a reservation made
        // before its run (the same one on both databases), and is dropped while there is none.
        prop_assert_eq!(a.reservations.len(), b.reservations.len(), "reservations made differ");
        let mut run: Vec<(Item, i64)> = Vec::new();
        for step in &steps[i..i + writes] {
            let item = match *step {
                Step::Order(spec) => Item::Order(order_job(spec, tenants, scenario.ttl_ms)),
                Step::Move(_, _) if a.reservations.is_empty() => continue,
                Step::Move(confirm, n) => {
                    let to = if confirm { ReservationState::Confirmed } else { ReservationState::Released };
                    let job = |db: &Db| {
                        let (tenant, id) = db.reservations[n % db.reservations.len()].clone();
                        batch::MoveJob { tenant, id, to }
                    };
                    Item::Move { a: job(&a), b: job(&b) }
                }
                Step::Other(_) => continue,
            };
            now_ms += 1;
            run.push((item, now_ms));
        }
        i += writes;
        while !run.is_empty() {
            let size = sizes.next().expect("group sizes").min(run.len());
            let group: Vec<(Item, i64)> = run.drain(..size).collect();
            let decided = b.batched(&group);
            prop_assert!(decided.admission_error.is_none(), "admission failed: {:?}", decided.admission_error);
            bump(&stats.groups, 1);
            bump(&stats.admitted, decided.admitted);
            bump(&stats.answered, decided.answered);
            bump(&stats.moved, decided.moved);
            bump(&stats.left, decided.left);
            bump(&stats.bucketed, decided.bucketed);
            bump(&stats.bucketed_moves, decided.bucketed_moves);
            if decided.admitted + decided.answered + decided.moved > 0 && decided.left > 0 {
                bump(&stats.mixed, 1);
            }
            // A takes B's effective order: see the module docs.
            let effective: Vec<usize> = decided.effective.iter().map(|(k, _)| *k).collect();
            for (k, answered) in decided.effective {
                let at = group[k].1;
                match (&group[k].0, answered) {
                    (Item::Order(job), Answer::Order(rb)) => {
                        let ra = a.alone(job, at);
                        let (ta, tb) = (answer(&mut a.ids, &ra), answer(&mut b.ids, &rb));
                        prop_assert!(!ta.starts_with("Err"), "order {} failed per order: {}", job.idempotency.key, ta);
                        prop_assert_eq!(
                            ta,
                            tb,
                            "order #{} of a group of {} (effective order {:?}) answered differently",
                            k,
                            size,
                            effective
                        );
                        a.note_reservation(job, &ra);
                        b.note_reservation(job, &rb);
                    }
                    (Item::Move { a: job, .. }, Answer::Move(rb)) => {
                        let ra = a.work(|conn| run_now(reservations::execute(&mut SqlitePort::new(conn), job, at)));
                        let (ta, tb) = (a.ids.debug(&ra), b.ids.debug(&rb));
                        prop_assert!(!ta.starts_with("Err"), "a move failed on its own: {}", ta);
                        prop_assert_eq!(
                            ta,
                            tb,
                            "move #{} of a group of {} (effective order {:?}) answered differently",
                            k,
                            size,
                            effective
                        );
                    }
                    _ => prop_assert!(false, "write #{} of a group answered as another kind", k),
                }
            }
            same_resources(&mut a, &mut b, &format!("a group of {size}"))?;
        }
    }

    balanced(&a, "per-order")?;
    balanced(&b, "batched")?;
    same_rows("ledger rows", &a.rows(LEDGER), &b.rows(LEDGER))?;
    let (mut ra, mut rb) = (a.rows(RESERVATIONS), b.rows(RESERVATIONS));
    ra.sort();
    rb.sort();
    same_rows("reservations", &ra, &rb)?;
    same_rows("user limits", &a.rows(USER_LIMITS), &b.rows(USER_LIMITS))?;
    same_rows("idempotency records", &a.rows(IDEMPOTENCY), &b.rows(IDEMPOTENCY))?;
    same_rows("events", &a.rows(EVENTS), &b.rows(EVENTS))
}

/// A property test's configuration: `PROPTEST_CASES` cases (default 64), its regressions kept
/// beside `source_file` under `test_name`.
pub(super) fn property_config(source_file: &'static str, test_name: &'static str) -> Config {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64);
    Config { cases, source_file: Some(source_file), test_name: Some(test_name), ..Config::default() }
}

/// Proves that deciding orders by batch admission ([`batch::admit`], as the SQLite writer
/// groups them) and deciding each on its own ([`orders::execute`]) give the same answers, the
/// same ledger rows and the same final state (resources, reservations, per-user limits,
/// idempotency records) for random sequences of orders (deduct or reserve, every partial
/// policy, fallback targets, missing resources, kinds, limits, creation, replays and key
/// mismatches) mixed with confirms, releases, expiries, adjustments and status changes, with
/// every resource balanced throughout. `PROPTEST_CASES` sets the number of cases (default 64).
#[test]
fn batch_admission_and_the_per_order_path_agree() {
    let config = property_config(file!(), "apply::tests::batch_admission_and_the_per_order_path_agree");
    let cases = config.cases;
    let stats = Stats::default();
    let mut runner = TestRunner::new(config);
    if let Err(failure) = runner.run(&scenario(), |scenario| run(&scenario, &stats)) {
        panic!("{failure}");
    }
    eprintln!(
        "{cases} cases: {} groups; admission decided {} orders ({} applied to buckets) and {} moves ({} out of \
         buckets) and answered {} from earlier outcomes, left {} to the per-request path; {} groups mixed both",
        stats.groups.get(),
        stats.admitted.get(),
        stats.bucketed.get(),
        stats.moved.get(),
        stats.bucketed_moves.get(),
        stats.answered.get(),
        stats.left.get(),
        stats.mixed.get()
    );
    assert!(
        stats.admitted.get() > 0
            && stats.answered.get() > 0
            && stats.moved.get() > 0
            && stats.left.get() > 0
            && stats.mixed.get() > 0
            && stats.bucketed.get() > 0
            && stats.bucketed_moves.get() > 0,
        "the scenarios did not exercise every path of batch admission"
    );
}
