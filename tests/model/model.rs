//! The reference model: what every acknowledged answer implies about the resources and
//! reservations of one tenant, and how much of it is not yet known.
//!
//! The model is exact where the contract is exact and an interval where the contract leaves
//! room: a reservation past its deadline may or may not have been expired by the sweeper yet;
//! a request whose answer was lost (a killed process, a `503`) may or may not have applied until
//! its retry with the same key says which. Predictions are made against the interval (`lo` and
//! `hi` of each resource's available stock): an order that fits `lo` must apply, one beyond
//! `hi` must be refused, anything between may go either way and the answer tells the model
//! which. Nothing here does I/O; `sim.rs` drives the servers and feeds the answers in.

use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;

/// A held reservation this close to its deadline (or past it) may already be expired by the
/// server: requests take time to arrive, and the sweeper runs on its own. Before it, the
/// reservation is certainly held.
pub const DUE_MARGIN: Duration = Duration::from_secs(5);

/// How long after a mode change or plugin activation another process may still act on its
/// older view (`[redis] mode_refresh_ms` and `[plugins] cache_ttl_ms` are 500 ms in the model's
/// servers; the rest is slack for a loaded machine).
pub const STALE_VIEW: Duration = Duration::from_secs(3);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Db,
    Redis,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Db => "db",
            Mode::Redis => "redis",
        }
    }
}

/// One resource as the acknowledged answers left it.
#[derive(Debug)]
pub struct Resource {
    pub key: String,
    pub mode: Mode,
    pub total: i64,
    pub consumed: i64,
    /// When the mode last changed: until `STALE_VIEW` later another process may still route by
    /// the old one.
    pub mode_changed: Instant,
    /// In redis mode: whether Redis holds the resource (false after a Redis restart until a warm).
    pub warmed: bool,
    /// Stock returned in the database (release or expiry of a reservation carried over a Redis
    /// data loss) that Redis has not seen, until the next warm (docs/REDIS.md, "Limits").
    pub shortfall: i64,
    /// In redis mode, Redis restored from an older snapshot: it sells from stock the database
    /// may no longer hold, until the next warm (or adjustment, or switch to db) reloads it.
    pub diverged: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RsvState {
    Held,
    Confirmed,
    Released,
    Expired,
}

impl RsvState {
    pub fn parse(text: &str) -> Option<RsvState> {
        match text {
            "held" => Some(RsvState::Held),
            "confirmed" => Some(RsvState::Confirmed),
            "released" => Some(RsvState::Released),
            "expired" => Some(RsvState::Expired),
            _ => None,
        }
    }

    /// The ledger op of the move into this state (none for `held`).
    pub fn ledger_op(self) -> Option<&'static str> {
        match self {
            RsvState::Held => None,
            RsvState::Confirmed => Some("confirm"),
            RsvState::Released => Some("release"),
            RsvState::Expired => Some("expire"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Move {
    Confirm,
    Release,
}

impl Move {
    pub fn path(self, id: &str) -> String {
        match self {
            Move::Confirm => format!("/v1/reservations/{id}/confirm"),
            Move::Release => format!("/v1/reservations/{id}/release"),
        }
    }

    fn target(self) -> RsvState {
        match self {
            Move::Confirm => RsvState::Confirmed,
            Move::Release => RsvState::Released,
        }
    }
}

#[derive(Debug)]
pub struct Reservation {
    pub id: String,
    pub order_id: String,
    pub lines: Vec<(usize, i64)>,
    pub expires_at: SystemTime,
    pub state: RsvState,
    /// A confirm or release whose answer was lost; retried until one comes back.
    pub pending: Option<Move>,
    /// Held in Redis when Redis lost its data: continued on the database path, where its
    /// release or expiry is invisible to Redis until the next warm.
    pub carried_over: bool,
    /// Confirmed or released in Redis after its deadline had come (due): the database's sweeper
    /// may have expired it first, and the move then fails to settle (docs/REDIS.md,
    /// "Reservations"). Settled by `Sim::resolve_late_moves` once nothing is left to settle.
    pub late_redis_move: bool,
    /// Its final state differs between Redis and the database (a late move the database
    /// refused): no longer read or moved through the API.
    pub disputed: bool,
}

impl Reservation {
    /// Whether the server may already have expired it.
    pub fn due(&self, now: SystemTime) -> bool {
        now + DUE_MARGIN >= self.expires_at
    }

    /// The states the server may hold it in now.
    pub fn possible(&self, now: SystemTime) -> Vec<RsvState> {
        let mut states = vec![self.state];
        if self.state == RsvState::Held {
            if self.due(now) {
                states.push(RsvState::Expired);
            }
            if let Some(pending) = self.pending {
                states.push(pending.target());
            }
        }
        states
    }
}

/// A keyed request (order or adjustment) and what it does if it applies.
#[derive(Debug, Clone)]
pub enum Effect {
    Order { action: Action, order_id: String, lines: Vec<(usize, i64)> },
    Adjust { rid: usize, delta: i64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Deduct,
    Reserve,
}

/// A keyed request, its path and body: what a retry or replay sends again.
#[derive(Debug, Clone)]
pub struct Request {
    pub path: String,
    pub key: String,
    pub body: Value,
    pub effect: Effect,
}

/// A stored outcome: the first answer to a keyed request, which every replay must repeat.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub request: Request,
    pub status: u16,
    pub content_type: String,
    pub text: String,
    /// A refusal decided by Redis is kept only in Redis (docs/REDIS.md, "Limits"): a Redis data
    /// loss forgets it, and the key may then be decided afresh.
    pub redis_refusal: bool,
    /// A refusal decided in Redis for a resource switched to db mode since: the switch deleted
    /// Redis's record of it, and a retry is decided afresh (a known bug, docs/TESTING.md).
    pub forgotten: bool,
}

/// An applied order: its id, action and lines (resource index, quantity).
pub type AppliedOrder = (String, Action, Vec<(usize, i64)>);

/// What the model requires of a request's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    MustApply,
    MustRefuse,
    Either,
}

/// The tenant's resources and reservations, the requests whose answers were lost, and the
/// stored outcomes replays must repeat.
#[derive(Debug, Default)]
pub struct Model {
    pub resources: Vec<Resource>,
    pub reservations: Vec<Reservation>,
    /// Keyed requests whose outcome is open (a lost answer, a `503`): retried with the same key.
    pub pending: Vec<Request>,
    /// Keyed requests known not to have applied and not stored (a `sold_out` answer, a refusal of
    /// the route by a process with an old view of the mode): sent again later with the same key.
    pub deferred: Vec<Request>,
    pub outcomes: Vec<Outcome>,
    /// Applied orders: (order id, action, lines), checked against the ledger.
    pub applied_orders: Vec<AppliedOrder>,
    /// Refused orders' ids: none may show in any ledger.
    pub refused_orders: Vec<String>,
    /// Plugin versions and when each stopped being active (`None`: active now).
    pub plugin_history: Vec<(i64, Option<Instant>)>,
    /// Plugin versions uploaded so far.
    pub plugin_versions: Vec<i64>,
    /// When a paused process was last resumed: its cached views (modes, plugin version) may be
    /// older than any change made while it was stopped, until it refreshes them.
    pub resumed_at: Option<Instant>,
}

impl Model {
    pub fn held(&self, rid: usize) -> i64 {
        self.reservations
            .iter()
            .filter(|r| r.state == RsvState::Held)
            .flat_map(|r| r.lines.iter())
            .filter(|(line_rid, _)| *line_rid == rid)
            .map(|(_, qty)| qty)
            .sum()
    }

    /// The exact counters (available, reserved, consumed, total) if nothing about this resource
    /// is open.
    pub fn certain(&self, rid: usize) -> (i64, i64, i64, i64) {
        let r = &self.resources[rid];
        let reserved = self.held(rid);
        (r.total - r.consumed - reserved, reserved, r.consumed, r.total)
    }

    /// Bounds of the resource's available stock as the server may hold it now (the database's,
    /// or Redis's logical stock in redis mode).
    pub fn bounds(&self, rid: usize, now: SystemTime) -> (i64, i64) {
        let (available, _, _, _) = self.certain(rid);
        let (mut lo, mut hi) = (available, available);
        for rsv in self.reservations.iter().filter(|r| r.state == RsvState::Held) {
            let may_return = rsv.due(now) || rsv.pending == Some(Move::Release);
            for (line_rid, qty) in &rsv.lines {
                if *line_rid == rid && may_return {
                    hi += qty;
                }
            }
        }
        for request in &self.pending {
            match &request.effect {
                Effect::Order { lines, .. } => {
                    for (line_rid, qty) in lines {
                        if *line_rid == rid {
                            lo -= qty;
                        }
                    }
                }
                Effect::Adjust { rid: adj_rid, delta } if *adj_rid == rid => {
                    lo += (*delta).min(0);
                    hi += (*delta).max(0);
                }
                Effect::Adjust { .. } => {}
            }
        }
        (lo, hi)
    }

    /// Bounds of what the deciding store holds: in redis mode Redis may lack stock the database
    /// got back from reservations carried over a Redis data loss.
    pub fn selling_bounds(&self, rid: usize, now: SystemTime) -> (i64, i64) {
        let (lo, hi) = self.bounds(rid, now);
        let r = &self.resources[rid];
        if r.mode == Mode::Db {
            return (lo, hi);
        }
        let carried: i64 = self
            .reservations
            .iter()
            .filter(|rsv| rsv.carried_over && rsv.state == RsvState::Held)
            .flat_map(|rsv| rsv.lines.iter())
            .filter(|(line_rid, _)| *line_rid == rid)
            .map(|(_, qty)| qty)
            .sum();
        (lo - r.shortfall - carried, hi)
    }

    /// Whether anything about this resource is open.
    pub fn is_open(&self, rid: usize, now: SystemTime) -> bool {
        let (lo, hi) = self.bounds(rid, now);
        let (available, ..) = self.certain(rid);
        lo != available || hi != available || self.pending_touches(rid)
    }

    fn pending_touches(&self, rid: usize) -> bool {
        self.pending.iter().any(|request| match &request.effect {
            Effect::Order { lines, .. } => lines.iter().any(|(r, _)| *r == rid),
            Effect::Adjust { rid: adj_rid, .. } => *adj_rid == rid,
        }) || self.reservations.iter().any(|rsv| rsv.pending.is_some() && rsv.lines.iter().any(|(r, _)| *r == rid))
    }

    /// What an all-or-nothing order of these lines must do.
    pub fn judge_order(&self, lines: &[(usize, i64)], now: SystemTime) -> Verdict {
        let mut all_fit = true;
        for (rid, qty) in lines {
            let (lo, hi) = self.selling_bounds(*rid, now);
            if *qty > hi {
                return Verdict::MustRefuse;
            }
            all_fit &= *qty <= lo;
        }
        if all_fit {
            Verdict::MustApply
        } else {
            Verdict::Either
        }
    }

    /// What a write-off (`delta < 0`) must do; a restock always applies here.
    pub fn judge_adjustment(&self, rid: usize, delta: i64, now: SystemTime) -> Verdict {
        if delta > 0 {
            return Verdict::MustApply;
        }
        let (lo, hi) = self.bounds(rid, now);
        if -delta <= lo {
            Verdict::MustApply
        } else if -delta > hi {
            Verdict::MustRefuse
        } else {
            Verdict::Either
        }
    }

    /// Applies an acknowledged order's effect.
    pub fn apply_order(
        &mut self,
        action: Action,
        order_id: &str,
        lines: &[(usize, i64)],
        reservation: Option<(String, SystemTime)>,
    ) {
        match action {
            Action::Deduct => {
                for (rid, qty) in lines {
                    self.resources[*rid].consumed += qty;
                }
            }
            Action::Reserve => {
                let (id, expires_at) = reservation.expect("an applied reservation has an id and a deadline");
                self.reservations.push(Reservation {
                    id,
                    order_id: order_id.to_owned(),
                    lines: lines.to_vec(),
                    expires_at,
                    state: RsvState::Held,
                    pending: None,
                    carried_over: false,
                    late_redis_move: false,
                    disputed: false,
                });
            }
        }
        self.applied_orders.push((order_id.to_owned(), action, lines.to_vec()));
    }

    /// Moves a reservation the server showed in `seen`; `Err` when `seen` is not a state the
    /// server may hold it in (a move the contract forbids, or one twice).
    pub fn observe_reservation(&mut self, index: usize, seen: RsvState, now: SystemTime) -> Result<(), String> {
        let rsv = &self.reservations[index];
        let possible = rsv.possible(now);
        if !possible.contains(&seen) {
            return Err(format!(
                "reservation {} (order {}) seen {seen:?}; the model allows {possible:?} (deadline in {:?})",
                rsv.id,
                rsv.order_id,
                rsv.expires_at.duration_since(now).unwrap_or_default()
            ));
        }
        if rsv.state == RsvState::Held && seen != RsvState::Held {
            let lines = rsv.lines.clone();
            let carried_over = rsv.carried_over;
            let late = rsv.due(now)
                && seen != RsvState::Expired
                && lines.iter().any(|(rid, _)| self.resources[*rid].mode == Mode::Redis);
            let rsv = &mut self.reservations[index];
            rsv.state = seen;
            rsv.pending = None;
            rsv.late_redis_move = late;
            for (rid, qty) in lines {
                match seen {
                    RsvState::Confirmed => self.resources[rid].consumed += qty,
                    _ if carried_over && self.resources[rid].mode == Mode::Redis => {
                        self.resources[rid].shortfall += qty
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// Marks a plugin version active from now on.
    pub fn activate_plugin(&mut self, version: i64) {
        let now = Instant::now();
        for (_, until) in self.plugin_history.iter_mut() {
            if until.is_none() {
                *until = Some(now);
            }
        }
        self.plugin_history.push((version, None));
    }

    /// Whether an order planned just now may name this plugin version: the active one, or one
    /// active until less than `STALE_VIEW` ago (another process's cache).
    pub fn plugin_may_plan(&self, version: i64) -> bool {
        let resumed = self.resumed_at.is_some_and(|t| t.elapsed() < STALE_VIEW);
        self.plugin_history
            .iter()
            .any(|(v, until)| *v == version && (resumed || until.is_none_or(|t| t.elapsed() < STALE_VIEW)))
    }

    /// Whether a mode change of any of these resources is recent enough for another process to
    /// still route by the old mode.
    pub fn mode_recently_changed(&self, lines: &[(usize, i64)]) -> bool {
        self.resumed_at.is_some_and(|t| t.elapsed() < STALE_VIEW)
            || lines.iter().any(|(rid, _)| self.resources[*rid].mode_changed.elapsed() < STALE_VIEW)
    }
}
