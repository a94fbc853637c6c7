//! The driver: starts the processes and the private Redis, chooses each step from the seed,
//! sends it to a live process, feeds the answer to the model (`model.rs`) and checks the
//! servers against it: cheaply after every step, in full (settled, ledgers, reconciliation,
//! Redis) every `FULL_CHECK_EVERY` steps, after every fault and at the end.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Display;
use std::time::{Duration, SystemTime};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use reqwest::{Method, RequestBuilder};
use serde_json::{json, Value};

use crate::helpers::{
    plugin_wasm, replay_ledger, spawn_app_on, try_send, unique, AppOptions, Backend, Counts, Reply, TenantClient,
    TestApp,
};
use crate::model::{Action, Effect, Mode, Model, Move, Outcome, Request, Resource, RsvState, Verdict, STALE_VIEW};
use crate::redis_support::RedisServer;

/// Steps per test when `STOCKD_MODEL_STEPS` is not set: what CI runs.
const DEFAULT_STEPS: u64 = 250;
/// Steps between two full checks (besides the ones after each fault and at the end).
const FULL_CHECK_EVERY: u64 = 40;
/// How long the full check may take to resolve open requests and to see everything settled.
const QUIESCE_DEADLINE: Duration = Duration::from_secs(90);
/// How long a mode switch, warm or plugin change may keep answering `503` before the test fails.
const CONTROL_DEADLINE: Duration = Duration::from_secs(45);
/// Pause between two polls of observable state.
const POLL: Duration = Duration::from_millis(100);
/// Per-request limit while a process is paused: a request stuck behind a lock the paused
/// process holds ends the pause instead of hanging the run.
const PAUSED_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Resources of the tenant; the last `REDIS_RESOURCES` start in redis mode.
const RESOURCES: usize = 5;
const REDIS_RESOURCES: usize = 2;
/// Plugin uploads per run (each compiles a component, which costs seconds in a debug build).
const MAX_UPLOADS: usize = 2;
/// Operations kept for the failure message.
const LOG_KEEP: usize = 80;
/// Operations kept for the log file written on failure.
const FULL_LOG_MAX_LINES: usize = 200_000;

/// Settings of every process: fast sweeps, reclaims and view refreshes, so a run spends its
/// time on operations rather than on waiting.
const CONFIG: &str = "\
[reservations]
sweep_interval_ms = 200
[redis]
claim_idle_ms = 500
drain_timeout_ms = 5000
lease_ms = 8000
mode_refresh_ms = 500
[plugins]
cache_ttl_ms = 500
";

struct Proc {
    app: TestApp,
    client: TenantClient,
    paused: bool,
}

pub struct Sim {
    backend: Backend,
    seed: u64,
    steps: u64,
    step: u64,
    rng: StdRng,
    procs: Vec<Proc>,
    redis: RedisServer,
    model: Model,
    log: VecDeque<String>,
    full_log: Vec<String>,
    stats: BTreeMap<&'static str, u64>,
    ids: u64,
    pause_left: u32,
    uploads: usize,
    /// The resources whose keys Redis held when it saved the snapshot a rollback will restore:
    /// those in redis mode then, and those in `stale_keys`.
    snapshot: Option<Vec<usize>>,
    /// Resources in db mode whose keys a rollback brought back into Redis (open, with the stock
    /// of then; nobody sells from them): they are in any snapshot saved meanwhile, until the
    /// resource is switched (which overwrites or deletes them) or Redis restarts empty.
    stale_keys: std::collections::HashSet<usize>,
    /// The servers' Redis key prefix.
    redis_prefix: String,
    /// Sales Redis acknowledged for a diverged resource: (order id, idempotency key, resource,
    /// quantity). Each ends in the ledger or in the settlement failures.
    diverged_sales: Vec<(String, String, usize, i64)>,
    /// Idempotency keys of sales whose settlement failure a rollback explains.
    explained_failures: std::collections::HashSet<String>,
}

/// Runs one model check: `processes` servers on one fresh database of `backend`.
pub async fn run(backend: Backend, processes: usize, salt: u64) {
    let seed = match std::env::var("STOCKD_MODEL_SEED") {
        Ok(text) => text.parse().unwrap_or_else(|_| panic!("STOCKD_MODEL_SEED={text:?} is not a u64")),
        Err(_) => rand::random::<u64>() >> 1,
    };
    let steps = match std::env::var("STOCKD_MODEL_STEPS") {
        Ok(text) => text.parse().unwrap_or_else(|_| panic!("STOCKD_MODEL_STEPS={text:?} is not a number")),
        Err(_) => DEFAULT_STEPS,
    };
    eprintln!("model check on {backend:?} x{processes}: STOCKD_MODEL_SEED={seed} STOCKD_MODEL_STEPS={steps}");
    let started = std::time::Instant::now();

    let redis = RedisServer::start().await;
    let redis_prefix = unique("model");
    let opts = AppOptions::default()
        .env("STOCKD_REDIS_URL", &redis.url())
        .env("STOCKD_REDIS_PREFIX", &redis_prefix)
        .toml(CONFIG);
    let first = spawn_app_on(backend, opts).await;
    let tenant = first.create_tenant("shop").await;
    let mut procs = vec![Proc { client: tenant.clone(), app: first, paused: false }];
    for _ in 1..processes {
        let app = procs[0].app.spawn_sibling().await;
        let client = app.tenant_with_key("shop", &tenant.api_key);
        procs.push(Proc { app, client, paused: false });
    }
    let mut sim = Sim {
        backend,
        seed,
        steps,
        step: 0,
        rng: StdRng::seed_from_u64(seed ^ salt),
        procs,
        redis,
        model: Model::default(),
        log: VecDeque::new(),
        full_log: Vec::new(),
        stats: BTreeMap::new(),
        ids: 0,
        pause_left: 0,
        uploads: 0,
        snapshot: None,
        redis_prefix,
        diverged_sales: Vec::new(),
        explained_failures: std::collections::HashSet::new(),
        stale_keys: std::collections::HashSet::new(),
    };
    sim.model.activate_plugin(0);
    sim.create_resources().await;
    for step in 0..steps {
        sim.step = step;
        sim.one_step().await;
        if (step + 1) % FULL_CHECK_EVERY == 0 {
            sim.full_check("periodic").await;
        }
    }
    sim.step = steps;
    sim.full_check("final").await;
    eprintln!(
        "model check on {backend:?} x{processes} passed: seed {seed}, {steps} steps in {:.1?}; {:?}",
        started.elapsed(),
        sim.stats
    );
}

impl Sim {
    // ---------------------------------------------------------------- plumbing

    #[track_caller]
    fn fail(&self, message: impl Display) -> ! {
        let mut logs = String::new();
        for (i, proc) in self.procs.iter().enumerate() {
            let text = proc.app.logs();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(40)..].join("\n");
            logs.push_str(&format!("--- process {i} (last output)\n{tail}\n"));
        }
        let ops: Vec<&str> = self.log.iter().map(String::as_str).collect();
        let path = std::env::temp_dir().join(format!("stockd-model-{}-x{}.log", self.seed, self.procs.len()));
        let saved = match std::fs::write(&path, self.full_log.join("\n")) {
            Ok(()) => format!("every operation: {}", path.display()),
            Err(e) => format!("the operation log could not be written to {}: {e}", path.display()),
        };
        panic!(
            "MODEL CHECK FAILED at step {} of {}: {message}\nreproduce: STOCKD_MODEL_SEED={} STOCKD_MODEL_STEPS={}\n\
             {saved}\nrecent operations:\n{}\n{logs}",
            self.step,
            self.steps,
            self.seed,
            self.steps,
            ops.join("\n")
        );
    }

    fn note(&mut self, text: String) {
        if self.log.len() == LOG_KEEP {
            self.log.pop_front();
        }
        let line = format!("[{}] {text}", self.step);
        if self.full_log.len() < FULL_LOG_MAX_LINES {
            self.full_log.push(line.clone());
        }
        self.log.push_back(line);
    }

    fn count(&mut self, what: &'static str) {
        *self.stats.entry(what).or_default() += 1;
    }

    fn fresh(&mut self, tag: &str) -> String {
        self.ids += 1;
        format!("{tag}-{}", self.ids)
    }

    /// A process that is running and not paused, chosen by the seed.
    fn live(&mut self) -> usize {
        let live: Vec<usize> = (0..self.procs.len()).filter(|&i| !self.procs[i].paused).collect();
        live[self.rng.random_range(0..live.len())]
    }

    /// Sends a request built for process `p`'s tenant client; transport errors are returned.
    async fn send(&mut self, p: usize, build: impl FnOnce(&TenantClient) -> RequestBuilder) -> Result<Reply, String> {
        let mut request = build(&self.procs[p].client);
        let paused = self.procs.iter().any(|proc| proc.paused);
        if paused {
            request = request.timeout(PAUSED_REQUEST_TIMEOUT);
        }
        let reply = try_send(request).await.map_err(|e| format!("{e:?}"));
        if reply.is_err() && paused {
            // Stuck behind something the paused process holds: end the pause.
            self.note("a request timed out during a pause: resuming".to_owned());
            self.resume_all().await;
        }
        if reply.is_err() {
            self.assert_processes_running();
        }
        reply
    }

    fn assert_processes_running(&mut self) {
        for i in 0..self.procs.len() {
            if !self.procs[i].app.is_running() {
                self.fail(format!("process {i} exited on its own"));
            }
        }
    }

    /// GET that must answer 200 (retrying `503`s until `CONTROL_DEADLINE`).
    async fn get_json(&mut self, path: &str) -> Value {
        let deadline = tokio::time::Instant::now() + CONTROL_DEADLINE;
        loop {
            let p = self.live();
            let reply = self.send(p, |c| c.request(Method::GET, path)).await;
            match reply {
                Ok(reply) if reply.status() == 200 => return reply.json(),
                Ok(reply) if reply.status() == 503 => {}
                Ok(reply) => self.fail(format!("GET {path}: {} {}", reply.status(), reply.text)),
                Err(_) => {}
            }
            if tokio::time::Instant::now() >= deadline {
                self.fail(format!("GET {path} kept failing"));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn signal(&self, p: usize, signal: &str) {
        let pid = self.procs[p].app.pid().to_string();
        let sent = std::process::Command::new("kill").args([signal, &pid]).status().expect("the kill command exists");
        assert!(sent.success(), "kill {signal} {pid} failed");
    }

    async fn resume_all(&mut self) {
        for p in 0..self.procs.len() {
            if self.procs[p].paused {
                self.signal(p, "-CONT");
                self.procs[p].paused = false;
                self.model.resumed_at = Some(std::time::Instant::now());
            }
        }
        self.pause_left = 0;
    }

    // ---------------------------------------------------------------- setup

    async fn create_resources(&mut self) {
        for i in 0..RESOURCES {
            let key = format!("sku-{i}");
            let total = self.rng.random_range(8..=30);
            let mode = if i >= RESOURCES - REDIS_RESOURCES { Mode::Redis } else { Mode::Db };
            let body = json!({"key": key, "kind": "inventory", "total": total, "mode": mode.name()});
            let p = self.live();
            let reply = self.send(p, |c| c.request(Method::POST, "/v1/resources").json(&body)).await;
            match reply {
                Ok(reply) if reply.status() == 201 => {}
                other => self.fail(format!("creating {key}: {other:?}")),
            }
            self.model.resources.push(Resource {
                key,
                mode,
                total,
                consumed: 0,
                mode_changed: std::time::Instant::now() - STALE_VIEW,
                warmed: true,
                shortfall: 0,
                diverged: false,
            });
        }
    }

    // ---------------------------------------------------------------- steps

    async fn one_step(&mut self) {
        if self.pause_left > 0 {
            self.pause_left -= 1;
            if self.pause_left == 0 {
                self.note("SIGCONT".to_owned());
                self.resume_all().await;
            }
        }
        let paused = self.procs.iter().any(|p| p.paused);
        let roll = self.rng.random_range(0..1000);
        let touched = match roll {
            0..=259 => self.order_step(Action::Deduct).await,
            260..=399 => self.order_step(Action::Reserve).await,
            400..=479 => self.move_step(Move::Confirm).await,
            480..=539 => self.move_step(Move::Release).await,
            540..=554 => self.get_reservation_step().await,
            555..=569 => self.late_redis_pass_step().await,
            570..=659 => self.adjust_step().await,
            660..=759 => self.replay_step(false).await,
            760..=799 => self.replay_step(true).await,
            800..=849 => self.retry_open_step().await,
            850..=879 => self.switch_step().await,
            880..=899 => self.warm_step().await,
            900..=914 => self.plugin_step().await,
            915..=939 if !paused => self.kill_step().await,
            940..=959 if !paused && self.procs.len() > 1 => self.pause_step(),
            960..=969 if !paused && self.snapshot.is_some() => self.redis_rollback_step().await,
            960..=969 if !paused => self.redis_restart_step().await,
            970..=979 if !paused && self.snapshot.is_none() => self.redis_snapshot_step().await,
            980..=989 if !paused => self.hold_step().await,
            _ => self.order_step(Action::Deduct).await,
        };
        for rid in touched {
            self.check_resource(rid).await;
        }
    }

    /// Lines for an order: one line mostly, else two or three distinct db-mode resources; now and
    /// then a multi-line order that names a redis-mode resource (refused as a whole).
    fn choose_lines(&mut self) -> (Vec<(usize, i64)>, bool) {
        let n = self.model.resources.len();
        if self.rng.random_bool(0.7) {
            let rid = self.rng.random_range(0..n);
            return (vec![(rid, self.rng.random_range(1..=6))], false);
        }
        let mut rids: Vec<usize> = (0..n).collect();
        let with_redis = self.rng.random_bool(0.1);
        if !with_redis {
            rids.retain(|&rid| self.model.resources[rid].mode == Mode::Db);
        }
        if rids.len() < 2 {
            let rid = self.rng.random_range(0..n);
            return (vec![(rid, self.rng.random_range(1..=6))], false);
        }
        let count = self.rng.random_range(2..=3).min(rids.len());
        let mut lines = Vec::new();
        for _ in 0..count {
            let rid = rids.remove(self.rng.random_range(0..rids.len()));
            lines.push((rid, self.rng.random_range(1..=4)));
        }
        let names_redis = lines.iter().any(|(rid, _)| self.model.resources[*rid].mode == Mode::Redis);
        (lines, names_redis)
    }

    async fn order_step(&mut self, action: Action) -> Vec<usize> {
        let (lines, expect_unsupported) = self.choose_lines();
        // No reservation in Redis while a snapshot may restore it: Redis would hold it again
        // after the database moved it on (see `redis_snapshot_step`).
        let action =
            if self.rollback_window() && lines.iter().any(|(rid, _)| self.model.resources[*rid].mode == Mode::Redis) {
                Action::Deduct
            } else {
                action
            };
        let order_id = self.fresh("ord");
        let key = self.fresh("idem");
        let json_lines: Vec<Value> =
            lines.iter().map(|(rid, qty)| json!({"key": self.model.resources[*rid].key, "qty": qty})).collect();
        let mut body = json!({"order_id": order_id, "action": match action { Action::Deduct => "deduct", Action::Reserve => "reserve" }, "lines": json_lines});
        if action == Action::Reserve {
            let ttl = if self.rng.random_bool(0.5) { self.rng.random_range(1..=2) } else { 3600 };
            body["ttl_seconds"] = json!(ttl);
        }
        let request = Request {
            path: "/v1/orders".to_owned(),
            key,
            body,
            effect: Effect::Order { action, order_id, lines: lines.clone() },
        };
        if expect_unsupported && !self.model.mode_recently_changed(&lines) {
            return self.unsupported_step(request).await;
        }
        let p = self.live();
        let reply = self.send(p, |c| c.keyed(&request.path, &request.key, &request.body)).await;
        let verdict = self.verdict(&request);
        self.absorb(request, reply, Some(verdict)).await;
        lines.iter().map(|(rid, _)| *rid).collect()
    }

    /// Whether a snapshot may be restored (or a restored one still sells): no reservation is
    /// made in Redis then, as Redis would hold it again after the database moved it on.
    fn rollback_window(&self) -> bool {
        self.snapshot.is_some() || self.model.resources.iter().any(|r| r.diverged)
    }

    /// A fresh one-line deduction of `qty` from resource `rid`.
    fn one_line_deduct(&mut self, rid: usize, qty: i64) -> Request {
        self.one_line(Action::Deduct, rid, qty)
    }

    /// A fresh one-line order of `qty` of resource `rid`.
    fn one_line(&mut self, action: Action, rid: usize, qty: i64) -> Request {
        let order_id = self.fresh("ord");
        let name = match action {
            Action::Deduct => "deduct",
            Action::Reserve => "reserve",
        };
        Request {
            path: "/v1/orders".to_owned(),
            key: self.fresh("idem"),
            body: json!({"order_id": order_id, "action": name, "lines": [{"key": self.model.resources[rid].key, "qty": qty}]}),
            effect: Effect::Order { action, order_id, lines: vec![(rid, qty)] },
        }
    }

    /// A multi-line order naming a redis-mode resource whose mode is settled everywhere:
    /// `422 redis_order_unsupported`, nothing applied, nothing stored.
    async fn unsupported_step(&mut self, request: Request) -> Vec<usize> {
        let p = self.live();
        let reply = self.send(p, |c| c.keyed(&request.path, &request.key, &request.body)).await;
        self.note(format!("order {} (names a redis-mode resource) -> {}", request.body, brief(&reply)));
        match reply {
            Ok(reply) if reply.status() == 422 && reply.json()["code"] == "redis_order_unsupported" => {
                self.count("order refused: redis_order_unsupported");
            }
            Ok(reply) if reply.status() == 503 => self.model.pending.push(request),
            Err(_) => self.model.pending.push(request),
            Ok(reply) => self.fail(format!(
                "a multi-line order naming a redis-mode resource answered {}: {}",
                reply.status(),
                reply.text
            )),
        }
        Vec::new()
    }

    fn verdict(&self, request: &Request) -> Verdict {
        let now = SystemTime::now();
        let lines: Vec<usize> = touched_by(request);
        if lines.iter().any(|rid| self.model.resources[*rid].diverged) {
            // Redis sells from restored stock; the database's stock waits for the resync.
            return Verdict::Either;
        }
        match &request.effect {
            Effect::Order { lines, .. } => self.model.judge_order(lines, now),
            Effect::Adjust { rid, delta } => self.model.judge_adjustment(*rid, *delta, now),
        }
    }

    /// Feeds a keyed request's answer to the model. `verdict` is `None` for the retry of a request
    /// whose first answer was lost: whichever outcome it replays is accepted.
    async fn absorb(&mut self, request: Request, reply: Result<Reply, String>, verdict: Option<Verdict>) {
        self.note(format!("{} key {} {} [{verdict:?}] -> {}", request.path, request.key, request.body, brief(&reply)));
        let reply = match reply {
            Ok(reply) => reply,
            Err(_) => {
                self.count("answer lost");
                self.model.pending.push(request);
                return;
            }
        };
        if verdict.is_some() && reply.replayed() {
            self.fail(format!("a key never used before was answered as a replay: {}", reply.text));
        }
        let status = reply.status();
        let problem_code = || -> String {
            if reply.content_type().starts_with("application/problem+json") {
                reply.json()["code"].as_str().unwrap_or_default().to_owned()
            } else {
                String::new()
            }
        };
        if status == 503 {
            let code = problem_code();
            if code != "unavailable" && code != "redis_not_warmed" {
                self.fail(format!("503 with code {code:?}: {}", reply.text));
            }
            if reply.header("retry-after").is_none() {
                self.fail(format!("503 without Retry-After: {}", reply.text));
            }
            self.count("503 (retried later)");
            self.model.pending.push(request);
            return;
        }
        match request.effect.clone() {
            Effect::Order { action, order_id, lines } => {
                if status == 422 && problem_code() == "redis_order_unsupported" {
                    let names_redis = lines.iter().any(|(rid, _)| self.model.resources[*rid].mode == Mode::Redis);
                    if names_redis && lines.len() > 1 {
                        self.count("order refused: redis_order_unsupported");
                        return;
                    }
                    // A process whose view of the mode is older than the change refuses the route.
                    if !self.model.mode_recently_changed(&lines) {
                        self.fail(format!("redis_order_unsupported for an order of db-mode resources: {}", reply.text));
                    }
                    self.count("order refused by a stale mode view (sent again later)");
                    self.model.deferred.push(request);
                    return;
                }
                if status != 201 && !(status == 409 && reply.content_type().starts_with("application/json")) {
                    self.fail(format!("an order answered {status}: {}", reply.text));
                }
                let doc = reply.json();
                self.check_order_doc(&doc, &lines, status, reply.replayed());
                if status == 201 {
                    if verdict == Some(Verdict::MustRefuse) {
                        self.fail(format!(
                            "an order beyond the available stock was applied (oversold): {}",
                            reply.text
                        ));
                    }
                    let reservation = (action == Action::Reserve).then(|| {
                        let id = doc["reservation_id"]
                            .as_str()
                            .unwrap_or_else(|| self.fail(format!("no reservation_id: {doc}")));
                        (id.to_owned(), parse_time(&doc["expires_at"]))
                    });
                    if lines.iter().any(|(rid, _)| self.model.resources[*rid].diverged) {
                        // Settles or fails against the database's stock: known at the resync.
                        let (rid, qty) = lines[0];
                        self.diverged_sales.push((order_id.clone(), request.key.clone(), rid, qty));
                        self.count("order applied in a diverged Redis");
                        self.record(request, &reply, true);
                        return;
                    }
                    self.model.apply_order(action, &order_id, &lines, reservation);
                    self.count(match action {
                        Action::Deduct => "order applied: deduct",
                        Action::Reserve => "order applied: reserve",
                    });
                    self.record(request, &reply, false);
                } else {
                    let sold_out = doc["lines"].as_array().into_iter().flatten().any(|l| l["reason"] == "sold_out");
                    if sold_out {
                        // Not stored: the key stays free. With stock the model says covers the
                        // order, the mark must clear (the restock's announcement reaching this
                        // process): the same request is sent again later.
                        if verdict == Some(Verdict::MustApply) {
                            self.count("order answered sold_out with stock (sent again later)");
                            self.model.deferred.push(request);
                        } else {
                            self.count("order refused: sold_out");
                        }
                        return;
                    }
                    if verdict == Some(Verdict::MustApply) {
                        self.fail(format!("an order the stock covers was refused: {}", reply.text));
                    }
                    self.count("order refused: insufficient");
                    let redis_refusal = lines.iter().any(|(rid, _)| self.model.resources[*rid].mode == Mode::Redis)
                        || self.model.mode_recently_changed(&lines);
                    self.model.refused_orders.push(order_id);
                    self.record(request, &reply, redis_refusal);
                }
            }
            Effect::Adjust { rid, delta } => {
                if status == 200 {
                    if verdict == Some(Verdict::MustRefuse) {
                        self.fail(format!("a write-off beyond the available stock was applied: {}", reply.text));
                    }
                    let state = reply.json();
                    self.check_invariant(&state);
                    self.model.resources[rid].total += delta;
                    self.count("adjustment applied");
                    self.record(request, &reply, false);
                    // An adjustment of a redis-mode resource drains and reloads Redis.
                    self.resync(rid).await;
                } else if status == 409 && problem_code() == "insufficient" {
                    if verdict == Some(Verdict::MustApply) {
                        self.fail(format!("a write-off the stock covers was refused: {}", reply.text));
                    }
                    self.count("adjustment refused: insufficient");
                    self.record(request, &reply, false);
                    self.resync(rid).await;
                } else {
                    self.fail(format!("an adjustment answered {status}: {}", reply.text));
                }
            }
        }
    }

    fn record(&mut self, request: Request, reply: &Reply, redis_refusal: bool) {
        self.model.outcomes.push(Outcome {
            request,
            status: reply.status(),
            content_type: reply.content_type().to_owned(),
            text: reply.text.clone(),
            redis_refusal,
            forgotten: false,
        });
    }

    fn check_order_doc(&self, doc: &Value, lines: &[(usize, i64)], status: u16, replayed: bool) {
        let expected_status = if status == 201 { "succeeded" } else { "rejected" };
        if doc["status"] != expected_status {
            self.fail(format!("order document status is not {expected_status}: {doc}"));
        }
        let doc_lines = doc["lines"].as_array().unwrap_or_else(|| self.fail(format!("no lines: {doc}")));
        if doc_lines.len() != lines.len() {
            self.fail(format!("{} lines answered for {}: {doc}", doc_lines.len(), lines.len()));
        }
        for (line, (rid, qty)) in doc_lines.iter().zip(lines) {
            let key = &self.model.resources[*rid].key;
            let applied = line["applied"].as_i64();
            let good = if status == 201 {
                line["status"] == "applied" && applied == Some(*qty) && line["key"] == *key
            } else {
                line["status"] != "applied"
                    && applied == Some(0)
                    && ["insufficient", "skipped", "sold_out"].iter().any(|r| line["reason"] == *r)
            };
            if !good {
                self.fail(format!("line for {key} x{qty} does not fit a {status}: {doc}"));
            }
        }
        if status == 409 && !doc_lines.iter().any(|l| l["reason"] == "insufficient" || l["reason"] == "sold_out") {
            self.fail(format!("a rejected order names no refused line: {doc}"));
        }
        if !replayed {
            let version = doc["plugin"]["version"].as_i64().unwrap_or(-1);
            let name = if version == 0 { "default" } else { "wasm" };
            if doc["plugin"]["name"] != name || !self.model.plugin_may_plan(version) {
                self.fail(format!(
                    "planned by {} though the active versions were {:?}",
                    doc["plugin"], self.model.plugin_history
                ));
            }
        }
    }

    /// Confirm or release a reservation the model knows (mostly a held one).
    async fn move_step(&mut self, mv: Move) -> Vec<usize> {
        let candidates: Vec<usize> = (0..self.model.reservations.len())
            .filter(|&i| self.model.reservations[i].pending.is_none_or(|p| p == mv))
            .filter(|&i| !self.model.reservations[i].disputed)
            .collect();
        if candidates.is_empty() {
            return self.order_step(Action::Reserve).await;
        }
        let held: Vec<usize> =
            candidates.iter().copied().filter(|&i| self.model.reservations[i].state == RsvState::Held).collect();
        let pool = if !held.is_empty() && self.rng.random_bool(0.75) { held } else { candidates };
        let index = pool[self.rng.random_range(0..pool.len())];
        self.send_move(index, mv).await;
        self.model.reservations[index].lines.iter().map(|(rid, _)| *rid).collect()
    }

    async fn send_move(&mut self, index: usize, mv: Move) {
        let path = mv.path(&self.model.reservations[index].id);
        if self.model.reservations[index].state == RsvState::Held {
            // In flight: from now on the server may hold it in the move's target state.
            self.model.reservations[index].pending = Some(mv);
        }
        let p = self.live();
        let reply = self.send(p, |c| c.request(Method::POST, &path)).await;
        self.note(format!("POST {path} -> {}", brief(&reply)));
        let seen = match &reply {
            Err(_) => None,
            Ok(reply) if reply.status() == 503 => None,
            Ok(reply) if reply.status() == 200 => {
                let state = reply.json()["state"].as_str().and_then(RsvState::parse);
                match (mv, state) {
                    (Move::Confirm, Some(RsvState::Confirmed)) => state,
                    (Move::Release, Some(RsvState::Released | RsvState::Expired)) => state,
                    _ => self.fail(format!("{path} answered 200 with {}", reply.text)),
                }
            }
            Ok(reply) if reply.status() == 409 => {
                let code = reply.json()["code"].as_str().unwrap_or_default().to_owned();
                match (mv, code.as_str()) {
                    (Move::Confirm, "reservation_released") => Some(RsvState::Released),
                    (Move::Confirm, "reservation_expired") => Some(RsvState::Expired),
                    (Move::Release, "reservation_confirmed") => Some(RsvState::Confirmed),
                    _ => self.fail(format!("{path} answered 409 {code}: {}", reply.text)),
                }
            }
            Ok(reply) => self.fail(format!("{path} answered {}: {}", reply.status(), reply.text)),
        };
        match seen {
            None => self.count("reservation move answer lost or 503 (retried later)"),
            Some(seen) => {
                self.count(match seen {
                    RsvState::Held => "reservation seen held",
                    RsvState::Confirmed => "reservation seen confirmed",
                    RsvState::Released => "reservation seen released",
                    RsvState::Expired => "reservation seen expired",
                });
                if let Err(e) = self.model.observe_reservation(index, seen, SystemTime::now()) {
                    self.fail(e);
                }
            }
        }
    }

    async fn get_reservation_step(&mut self) -> Vec<usize> {
        if self.model.reservations.is_empty() {
            return self.order_step(Action::Reserve).await;
        }
        let index = self.rng.random_range(0..self.model.reservations.len());
        if self.model.reservations[index].disputed {
            return Vec::new();
        }
        self.observe(index).await;
        self.model.reservations[index].lines.iter().map(|(rid, _)| *rid).collect()
    }

    /// Redis's own expiry pass comes late for one reservation Redis holds (made now, for 1-2 s,
    /// if none is held): its deadline is moved 3-5 s later in Redis's schedule (the
    /// reservation's own deadline, which moves go by, is left alone), so the database's sweeper
    /// expires the settled row first; mostly a warm follows while Redis still holds it (finding
    /// 8 in docs/TESTING.md). Nothing the contract promises changes: the stock comes back once.
    async fn late_redis_pass_step(&mut self) -> Vec<usize> {
        let held: Vec<usize> = (0..self.model.reservations.len())
            .filter(|&i| {
                let rsv = &self.model.reservations[i];
                rsv.state == RsvState::Held
                    && !rsv.disputed
                    && !rsv.carried_over
                    && rsv.lines.len() == 1
                    && self.model.resources[rsv.lines[0].0].mode == Mode::Redis
            })
            .collect();
        let index = match held.len() {
            0 => match self.short_redis_reservation().await {
                Some(index) => index,
                None => return self.get_reservation_step().await,
            },
            n => held[self.rng.random_range(0..n)],
        };
        let (id, rid) = (self.model.reservations[index].id.clone(), self.model.reservations[index].lines[0].0);
        let deadlines = format!("{}:{{shop:{}}}:e", self.redis_prefix, self.model.resources[rid].key);
        let delay_ms = self.rng.random_range(3_000..=5_000);
        let mut conn = crate::redis_support::redis_conn(&self.redis.url()).await;
        let at: Option<f64> = match redis::cmd("ZSCORE").arg(&deadlines).arg(&id).query_async(&mut conn).await {
            Ok(at) => at,
            Err(e) => self.fail(format!("ZSCORE {deadlines} {id}: {e}")),
        };
        if let Some(at) = at {
            let moved: Result<i64, _> = redis::cmd("ZADD")
                .arg(&deadlines)
                .arg("XX")
                .arg(at + delay_ms as f64)
                .arg(&id)
                .query_async(&mut conn)
                .await;
            if let Err(e) = moved {
                self.fail(format!("ZADD {deadlines} {id}: {e}"));
            }
            self.note(format!("Redis's expiry pass {delay_ms} ms late for reservation {id}"));
            self.count("redis expiry pass late");
            if self.rng.random_bool(0.7) {
                self.warm_after_the_sweeper(index, rid).await;
            }
        }
        vec![rid]
    }

    /// Waits (a short reservation only) until the database's sweeper has expired the reservation
    /// (its `expire` ledger entry), then warms its resource while Redis still holds it.
    async fn warm_after_the_sweeper(&mut self, index: usize, rid: usize) {
        let id = self.model.reservations[index].id.clone();
        let soon = SystemTime::now() + Duration::from_secs(3);
        if self.model.reservations[index].expires_at > soon {
            return;
        }
        let key = self.model.resources[rid].key.clone();
        let p = self.live();
        let client = self.procs[p].client.clone();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let entries = client.ledger(&key).await;
            if entries.iter().any(|e| e["reservation_id"] == id.as_str() && e["op"] != "reserve") {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                // Moved or expired some other way meanwhile (a kill, a pause): nothing to race.
                return;
            }
            tokio::time::sleep(POLL).await;
        }
        self.note(format!("the database moved reservation {id}; warm of {key} while Redis's pass is late"));
        self.warm(rid).await;
    }

    /// A fresh reservation of one piece for 1-2 s on a redis-mode resource (none while a
    /// snapshot may be restored, as in `order_step`); its index in the model once applied.
    async fn short_redis_reservation(&mut self) -> Option<usize> {
        let redis: Vec<usize> = (0..self.model.resources.len())
            .filter(|&rid| self.model.resources[rid].mode == Mode::Redis && self.model.resources[rid].warmed)
            .collect();
        if self.rollback_window() || redis.is_empty() {
            return None;
        }
        let rid = redis[self.rng.random_range(0..redis.len())];
        let mut request = self.one_line(Action::Reserve, rid, 1);
        request.body["ttl_seconds"] = json!(self.rng.random_range(1..=2));
        let order_id = request.body["order_id"].as_str().unwrap_or_default().to_owned();
        let p = self.live();
        let reply = self.send(p, |c| c.keyed(&request.path, &request.key, &request.body)).await;
        let verdict = self.verdict(&request);
        self.absorb(request, reply, Some(verdict)).await;
        self.model.reservations.iter().position(|r| r.order_id == order_id && r.state == RsvState::Held)
    }

    /// Reads a reservation and feeds its state to the model.
    async fn observe(&mut self, index: usize) -> RsvState {
        let path = format!("/v1/reservations/{}", self.model.reservations[index].id);
        let doc = self.get_json(&path).await;
        let seen =
            doc["state"].as_str().and_then(RsvState::parse).unwrap_or_else(|| self.fail(format!("{path}: {doc}")));
        if let Err(e) = self.model.observe_reservation(index, seen, SystemTime::now()) {
            self.fail(e);
        }
        seen
    }

    async fn adjust_step(&mut self) -> Vec<usize> {
        let rid = self.rng.random_range(0..self.model.resources.len());
        let delta =
            if self.rng.random_bool(0.55) { self.rng.random_range(3..=25) } else { -self.rng.random_range(1..=15) };
        let key = self.fresh("adj");
        let request = Request {
            path: format!("/v1/resources/{}/adjustments", self.model.resources[rid].key),
            key,
            body: json!({"delta": delta, "reason": if delta > 0 { "restock" } else { "write-off" }}),
            effect: Effect::Adjust { rid, delta },
        };
        let p = self.live();
        let reply = self.send(p, |c| c.keyed(&request.path, &request.key, &request.body)).await;
        let verdict = self.verdict(&request);
        self.absorb(request, reply, Some(verdict)).await;
        vec![rid]
    }

    /// Sends a stored outcome's request again: the same body must get the first answer byte
    /// for byte; another body under the same key `422 idempotency_key_mismatch`.
    async fn replay_step(&mut self, mismatch: bool) -> Vec<usize> {
        if self.model.outcomes.is_empty() {
            return self.order_step(Action::Deduct).await;
        }
        let outcome = self.model.outcomes[self.rng.random_range(0..self.model.outcomes.len())].clone();
        self.replay(outcome, mismatch).await
    }

    async fn replay(&mut self, outcome: Outcome, mismatch: bool) -> Vec<usize> {
        let mut body = outcome.request.body.clone();
        if mismatch {
            match outcome.request.effect {
                Effect::Order { .. } => {
                    let qty = body["lines"][0]["qty"].as_i64().unwrap_or(1);
                    body["lines"][0]["qty"] = json!(qty + 1);
                }
                Effect::Adjust { delta, .. } => body["delta"] = json!(delta + delta.signum()),
            }
        }
        let mut sent = outcome.request.clone();
        if let (true, Effect::Order { lines, .. }) = (mismatch, &mut sent.effect) {
            lines[0].1 += 1;
        }
        sent.body = body.clone();
        let p = self.live();
        let (path, key) = (outcome.request.path.clone(), outcome.request.key.clone());
        let reply = self.send(p, |c| c.keyed(&path, &key, &body)).await;
        self.note(format!("{} {path} key {key} -> {}", if mismatch { "MISMATCH" } else { "REPLAY" }, brief(&reply)));
        let reply = match reply {
            Ok(reply) if reply.status() != 503 => reply,
            _ => {
                self.count("replay answered 503 or lost");
                return Vec::new();
            }
        };
        if outcome.redis_refusal && answered_sold_out(&reply) {
            // Finding 1 (docs/TESTING.md), fixed: refusals Redis decides are settled into the
            // database, so a sold-out process finds them there.
            self.fail(format!(
                "a refusal Redis decided replayed as sold_out: key {key}, decided in Redis as {}, answered {}",
                outcome.text, reply.text
            ));
        }
        let as_stored = if mismatch {
            reply.status() == 422 && reply.json()["code"] == "idempotency_key_mismatch"
        } else {
            reply.replayed() && reply.text == outcome.text
        };
        if outcome.forgotten && !as_stored {
            // Finding 2 (docs/TESTING.md), fixed: the switch drains every refusal into the
            // database first.
            self.fail(format!(
                "a refusal Redis decided forgotten after a switch to db: key {key}, decided in Redis as {}, answered {}",
                outcome.text, reply.text
            ));
        }
        if mismatch {
            if reply.status() != 422 || reply.json()["code"] != "idempotency_key_mismatch" {
                self.fail(format!("key {key} reused with another body answered {}: {}", reply.status(), reply.text));
            }
            self.count("mismatch refused");
        } else {
            let same = reply.status() == outcome.status
                && reply.content_type() == outcome.content_type
                && reply.text == outcome.text
                && reply.replayed();
            if !same {
                self.fail(format!(
                    "replay of key {key} differs from its first answer:\nfirst:  {} {} {}\nreplay: {} {} {} (replayed header: {})",
                    outcome.status,
                    outcome.content_type,
                    outcome.text,
                    reply.status(),
                    reply.content_type(),
                    reply.text,
                    reply.replayed()
                ));
            }
            self.count("replay identical");
        }
        Vec::new()
    }

    /// Retries one open request (lost answer, 503) with its key, or sends a deferred one again.
    async fn retry_open_step(&mut self) -> Vec<usize> {
        if !self.model.pending.is_empty() {
            let request = self.model.pending.remove(self.rng.random_range(0..self.model.pending.len()));
            return self.retry(request).await;
        }
        if !self.model.deferred.is_empty() {
            let request = self.model.deferred.remove(self.rng.random_range(0..self.model.deferred.len()));
            let p = self.live();
            let reply = self.send(p, |c| c.keyed(&request.path, &request.key, &request.body)).await;
            let verdict = self.verdict(&request);
            let touched = touched_by(&request);
            self.absorb(request, reply, Some(verdict)).await;
            return touched;
        }
        if let Some(index) = self.model.reservations.iter().position(|r| r.pending.is_some()) {
            let mv = self.model.reservations[index].pending.expect("position found one");
            self.send_move(index, mv).await;
            return self.model.reservations[index].lines.iter().map(|(rid, _)| *rid).collect();
        }
        self.get_reservation_step().await
    }

    async fn retry(&mut self, request: Request) -> Vec<usize> {
        let p = self.live();
        let reply = self.send(p, |c| c.keyed(&request.path, &request.key, &request.body)).await;
        let touched = touched_by(&request);
        self.absorb(request, reply, None).await;
        touched
    }

    /// `PATCH {"mode"}` to the other mode, retried through `503` (another warm under way).
    async fn switch_step(&mut self) -> Vec<usize> {
        let rid = self.rng.random_range(0..self.model.resources.len());
        let target = match self.model.resources[rid].mode {
            Mode::Db => Mode::Redis,
            Mode::Redis => Mode::Db,
        };
        let path = format!("/v1/resources/{}", self.model.resources[rid].key);
        let body = json!({"mode": target.name()});
        let state = self.control(Method::PATCH, &path, Some(body)).await;
        if state["mode"] != target.name() {
            self.fail(format!("PATCH mode {} answered {state}", target.name()));
        }
        self.check_invariant(&state);
        let now = std::time::Instant::now();
        if target == Mode::Redis {
            // Reservations held in the database stay there: their return is invisible to Redis.
            for rsv in self.model.reservations.iter_mut() {
                if rsv.state == RsvState::Held && rsv.lines.iter().any(|(r, _)| *r == rid) {
                    rsv.carried_over = true;
                }
            }
        }
        if target == Mode::Db {
            for outcome in self.model.outcomes.iter_mut() {
                if let Effect::Order { lines, .. } = &outcome.request.effect {
                    if outcome.redis_refusal && lines.iter().any(|(r, _)| *r == rid) {
                        outcome.forgotten = true;
                    }
                }
            }
        }
        self.resync(rid).await;
        self.stale_keys.remove(&rid);
        let resource = &mut self.model.resources[rid];
        resource.mode = target;
        resource.mode_changed = now;
        resource.warmed = true;
        resource.shortfall = 0;
        self.count(if target == Mode::Redis { "switch to redis" } else { "switch to db" });
        vec![rid]
    }

    async fn warm_step(&mut self) -> Vec<usize> {
        let redis: Vec<usize> =
            (0..self.model.resources.len()).filter(|&rid| self.model.resources[rid].mode == Mode::Redis).collect();
        if redis.is_empty() {
            return self.switch_step().await;
        }
        let rid = redis[self.rng.random_range(0..redis.len())];
        self.warm(rid).await;
        vec![rid]
    }

    async fn warm(&mut self, rid: usize) {
        let path = format!("/v1/resources/{}/warm", self.model.resources[rid].key);
        let report = self.control(Method::POST, &path, None).await;
        if report["warmed"] != true || report["backlog"] != 0 {
            self.fail(format!("warm answered {report}"));
        }
        // Drift is exact only while nothing settles: a reservation expiring in Redis at this
        // moment settles on its own.
        let now = SystemTime::now();
        let expiring =
            self.model.reservations.iter().any(|r| {
                r.state == RsvState::Held && r.due(now) && r.lines.iter().any(|(line_rid, _)| *line_rid == rid)
            });
        if report["drift"] != 0 && !expiring {
            self.fail(format!("right after a warm Redis and the database differ: {report}"));
        }
        let resource = &mut self.model.resources[rid];
        resource.warmed = true;
        resource.shortfall = 0;
        self.count("warm");
        self.resync(rid).await;
    }

    /// A control request (mode switch, warm) retried through `503` until `CONTROL_DEADLINE`.
    async fn control(&mut self, method: Method, path: &str, body: Option<Value>) -> Value {
        let deadline = tokio::time::Instant::now() + CONTROL_DEADLINE;
        loop {
            let p = self.live();
            let reply = self
                .send(p, |c| {
                    let request = c.request(method.clone(), path);
                    match &body {
                        Some(body) => request.json(body),
                        None => request,
                    }
                })
                .await;
            self.note(format!("{method} {path} {body:?} -> {}", brief(&reply)));
            match reply {
                Ok(reply) if reply.status() == 200 => return reply.json(),
                Ok(reply) if reply.status() == 503 => {}
                Err(_) => {}
                Ok(reply) => self.fail(format!("{method} {path} answered {}: {}", reply.status(), reply.text)),
            }
            if tokio::time::Instant::now() >= deadline {
                self.fail(format!("{method} {path} kept answering 503 for {CONTROL_DEADLINE:?}"));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Upload the default plan as a WebAssembly plugin (a new version, same decisions), or
    /// activate a kept version (0: the built-in default).
    async fn plugin_step(&mut self) -> Vec<usize> {
        let p = self.live();
        let reply = if self.uploads < MAX_UPLOADS && self.rng.random_bool(0.4) {
            self.uploads += 1;
            let wasm = plugin_wasm("default");
            self.send(p, |c| c.request(Method::PUT, "/v1/plugin").header("content-type", "application/wasm").body(wasm))
                .await
        } else {
            let mut choices = vec![0];
            choices.extend(self.model.plugin_versions.iter().copied());
            let version = choices[self.rng.random_range(0..choices.len())];
            self.send(p, |c| c.request(Method::POST, &format!("/v1/plugin/versions/{version}/activate"))).await
        };
        self.note(format!("plugin change -> {}", brief(&reply)));
        match &reply {
            Ok(reply) if reply.status() == 200 || reply.status() == 201 => {
                let version = reply.json()["version"]
                    .as_i64()
                    .unwrap_or_else(|| self.fail(format!("no version: {}", reply.text)));
                if reply.status() == 201 {
                    self.model.plugin_versions.push(version);
                }
                self.model.activate_plugin(version);
                self.count("plugin version activated");
            }
            Ok(reply) if reply.status() == 429 || reply.status() == 503 => self.count("plugin change busy"),
            Err(_) => self.count("plugin change answer lost"),
            Ok(reply) => self.fail(format!("plugin change answered {}: {}", reply.status(), reply.text)),
        }
        // Whatever the answer, the process that took it knows the active version at once.
        let active = self.send(p, |c| c.request(Method::GET, "/v1/plugin")).await;
        if let Ok(active) = active.as_ref().map(Reply::json) {
            let version = active["version"].as_i64().unwrap_or(-1);
            if self.model.plugin_history.last().map(|(v, _)| *v) != Some(version) {
                if version > 0 && !self.model.plugin_versions.contains(&version) {
                    self.model.plugin_versions.push(version);
                }
                self.model.activate_plugin(version);
            }
        }
        Vec::new()
    }

    /// kill -9 a process, now and then with an order or adjustment in flight, and start it again
    /// on the same database; then everything acknowledged must still be there.
    async fn kill_step(&mut self) -> Vec<usize> {
        let p = self.rng.random_range(0..self.procs.len());
        let in_flight = if self.rng.random_bool(0.6) {
            let rid = self.rng.random_range(0..self.model.resources.len());
            let qty = self.rng.random_range(1..=3);
            let request = self.one_line_deduct(rid, qty);
            let verdict = self.verdict(&request);
            let builder = self.procs[p].client.keyed(&request.path, &request.key, &request.body);
            Some((request, verdict, tokio::spawn(try_send(builder))))
        } else {
            None
        };
        let delay = Duration::from_millis(self.rng.random_range(0..40));
        tokio::time::sleep(delay).await;
        self.note(format!("kill -9 process {p} (after {delay:?})"));
        self.procs[p].app.kill9().await;
        self.count("kill -9");
        let mut touched = Vec::new();
        if let Some((request, verdict, task)) = in_flight {
            let reply = task.await.expect("the request task does not panic").map_err(|e| format!("{e:?}"));
            touched = touched_by(&request);
            self.absorb(request, reply, Some(verdict)).await;
        }
        self.procs[p].app.restart().await;
        self.full_check("after kill -9 and restart").await;
        touched
    }

    /// SIGSTOP one process for a few steps: its settlement consumer stops mid-work, its claimed
    /// stream entries must be reclaimed by the other process, and nothing is sent to it.
    fn pause_step(&mut self) -> Vec<usize> {
        let p = self.rng.random_range(0..self.procs.len());
        self.pause_left = self.rng.random_range(2..=6);
        self.note(format!("SIGSTOP process {p} for {} steps", self.pause_left));
        self.signal(p, "-STOP");
        self.procs[p].paused = true;
        self.count("SIGSTOP");
        Vec::new()
    }

    /// Redis restarted empty, once everything acknowledged has settled: Redis forgets its
    /// refusals and its reservations (continued on the database path); resources answer
    /// `503 redis_not_warmed` until warmed.
    async fn redis_restart_step(&mut self) -> Vec<usize> {
        // Unsettled sales are lost with Redis's data (docs/REDIS.md, "Failure modes"): this
        // fault comes after everything acknowledged reached the database.
        self.quiesce().await;
        self.settle().await;
        self.note("Redis kill -9 and restart (empty)".to_owned());
        self.redis.restart().await;
        self.stale_keys.clear();
        self.count("redis restart");
        self.model.outcomes.retain(|o| !o.redis_refusal);
        let redis: Vec<usize> =
            (0..self.model.resources.len()).filter(|&rid| self.model.resources[rid].mode == Mode::Redis).collect();
        for &rid in &redis {
            self.model.resources[rid].warmed = false;
            for rsv in self.model.reservations.iter_mut() {
                if rsv.state == RsvState::Held && rsv.lines.iter().any(|(r, _)| *r == rid) {
                    rsv.carried_over = true;
                }
            }
        }
        for &rid in &redis {
            if self.rng.random_bool(0.5) {
                self.warm(rid).await;
            }
        }
        redis
    }

    /// The database's resources table held from outside (`TableHold`: settlement cannot
    /// commit, reads go on) while a few redis-mode orders sell and one stored outcome is
    /// replayed: sales, refusals, sold-out answers and replays come from Redis alone, and once
    /// the hold is released everything settles.
    async fn hold_step(&mut self) -> Vec<usize> {
        let redis: Vec<usize> = (0..self.model.resources.len())
            .filter(|&rid| self.model.resources[rid].mode == Mode::Redis && self.model.resources[rid].warmed)
            .filter(|&rid| !self.model.mode_recently_changed(&[(rid, 0)]))
            .collect();
        if redis.is_empty() {
            return self.order_step(Action::Deduct).await;
        }
        let url = self.procs[0].app.database_url().to_owned();
        let hold = crate::redis_support::TableHold::take_on(self.backend, &url).await;
        self.note("database's resources table held".to_owned());
        self.count("table hold");
        let mut touched = Vec::new();
        for _ in 0..self.rng.random_range(1..=4) {
            let rid = redis[self.rng.random_range(0..redis.len())];
            let qty = self.rng.random_range(1..=4);
            let request = self.one_line_deduct(rid, qty);
            let verdict = self.verdict(&request);
            let p = self.live();
            let reply = self.send(p, |c| c.keyed(&request.path, &request.key, &request.body)).await;
            self.absorb(request, reply, Some(verdict)).await;
            touched.push(rid);
        }
        // A replay answered from Redis's record (or the database's, by a read), never one that
        // might write while the table is held.
        let replayable: Vec<Outcome> = self
            .model
            .outcomes
            .iter()
            .filter(|o| !o.forgotten && touched_by(&o.request).iter().all(|rid| redis.contains(rid)))
            .cloned()
            .collect();
        if !replayable.is_empty() && self.rng.random_bool(0.7) {
            let outcome = replayable[self.rng.random_range(0..replayable.len())].clone();
            self.replay(outcome, false).await;
        }
        hold.release().await;
        self.note("hold released".to_owned());
        touched
    }

    /// Whether Redis may be snapshotted now: no reservation held on a redis-mode resource (a
    /// restore would hold it again after the database moved it on, a documented limit) and no
    /// resource diverged from an earlier restore.
    fn snapshot_allowed(&self, redis: &[usize]) -> bool {
        let held_in_redis = self
            .model
            .reservations
            .iter()
            .any(|rsv| rsv.state == RsvState::Held && rsv.lines.iter().any(|(rid, _)| redis.contains(rid)));
        !held_in_redis && !self.model.resources.iter().any(|r| r.diverged)
    }

    /// Redis saves a snapshot (`SAVE`) once everything has settled and no
    /// redis-mode resource holds a reservation; a later rollback restores it.
    async fn redis_snapshot_step(&mut self) -> Vec<usize> {
        let redis: Vec<usize> =
            (0..self.model.resources.len()).filter(|&rid| self.model.resources[rid].mode == Mode::Redis).collect();
        if !self.snapshot_allowed(&redis) {
            return self.order_step(Action::Deduct).await;
        }
        self.quiesce().await;
        self.settle().await;
        // Quiescing sends the requests whose answers were lost again: one may have just made a
        // reservation in Redis.
        if !self.snapshot_allowed(&redis) {
            self.count("snapshot skipped: a resent request reserved in Redis");
            return Vec::new();
        }
        let mut conn = crate::redis_support::redis_conn(&self.redis.url()).await;
        let saved: Result<String, _> = redis::cmd("SAVE").query_async(&mut conn).await;
        if let Err(e) = saved {
            self.fail(format!("redis SAVE: {e}"));
        }
        let mut held = redis.clone();
        held.extend(self.stale_keys.iter().copied());
        held.sort_unstable();
        self.note(format!("Redis SAVE (snapshot of redis-mode resources {redis:?}, keys of {held:?})"));
        self.count("redis snapshot");
        self.snapshot = Some(held);
        Vec::new()
    }

    /// Redis killed and restarted from the older snapshot, once everything acknowledged has
    /// settled: Redis gets back stock the database has since sold (docs/REDIS.md, "Failure
    /// modes"). Until a warm, what it sells beyond the database's stock must surface as
    /// settlement failures, never as a negative stock or a lost sale.
    async fn redis_rollback_step(&mut self) -> Vec<usize> {
        let snapshot = self.snapshot.take().expect("a rollback follows a snapshot");
        self.quiesce().await;
        self.settle().await;
        self.note(format!("Redis kill -9 and restart from the snapshot of {snapshot:?}"));
        self.redis.restart().await;
        // Only this restart loads the snapshot; the next one starts empty again.
        let dump = self.redis.dir().join("dump.rdb");
        if let Err(e) = std::fs::remove_file(&dump) {
            self.fail(format!("removing {}: {e}", dump.display()));
        }
        self.count("redis rollback to a snapshot");
        // Redis holds exactly the snapshot's keys now: those of db-mode resources come back open,
        // and every process must keep selling them on the database path.
        self.stale_keys =
            snapshot.iter().copied().filter(|&rid| self.model.resources[rid].mode != Mode::Redis).collect();
        if !self.stale_keys.is_empty() {
            self.count("redis rollback bringing back a resource switched to db since");
        }
        self.model.outcomes.retain(|o| !o.redis_refusal);
        let redis: Vec<usize> =
            (0..self.model.resources.len()).filter(|&rid| self.model.resources[rid].mode == Mode::Redis).collect();
        for &rid in &redis {
            let resource = &mut self.model.resources[rid];
            if snapshot.contains(&rid) {
                resource.diverged = true;
            } else {
                resource.warmed = false;
            }
            for rsv in self.model.reservations.iter_mut() {
                if rsv.state == RsvState::Held && rsv.lines.iter().any(|(r, _)| *r == rid) {
                    rsv.carried_over = true;
                }
            }
        }
        redis
    }

    /// After a warm, an adjustment or a switch drained a diverged resource: every sale Redis
    /// acknowledged meanwhile is in the ledger (the model applies it now) or listed as a
    /// settlement failure (explained by the rollback); nothing is dropped.
    async fn resync(&mut self, rid: usize) {
        if !self.model.resources[rid].diverged {
            return;
        }
        self.model.resources[rid].diverged = false;
        let sales: Vec<(String, String, usize, i64)> =
            self.diverged_sales.iter().filter(|s| s.2 == rid).cloned().collect();
        self.diverged_sales.retain(|s| s.2 != rid);
        if sales.is_empty() {
            return;
        }
        let key = self.model.resources[rid].key.clone();
        let p = self.live();
        let client = self.procs[p].client.clone();
        let entries = client.ledger(&key).await;
        let report = self.get_json("/v1/reconciliation").await;
        let failures = report["settlement_failures"].as_array().cloned().unwrap_or_default();
        for (order_id, idempotency_key, rid, qty) in sales {
            let settled: Vec<&Value> =
                entries.iter().filter(|e| e["order_id"] == order_id.as_str() && e["op"] == "deduct").collect();
            let failed = failures.iter().any(|f| f["idempotency_key"] == idempotency_key.as_str() && f["qty"] == qty);
            match (settled.len(), failed) {
                (1, false) if settled[0]["qty"] == qty => {
                    self.model.apply_order(Action::Deduct, &order_id, &[(rid, qty)], None);
                    self.count("diverged sale settled");
                }
                (0, true) => {
                    self.explained_failures.insert(idempotency_key.clone());
                    self.model.outcomes.retain(|o| o.request.key != idempotency_key);
                    self.count("diverged sale refused by the database (settlement failure)");
                }
                _ => self.fail(format!(
                    "sale {order_id} (key {idempotency_key}, {qty} of {key}) acknowledged by a restored Redis: \
                     ledger entries {settled:?}, in settlement failures: {failed}"
                )),
            }
        }
    }

    /// Once everything is settled: a confirm or release Redis made close to the reservation's
    /// deadline (within `DUE_MARGIN`; Redis expires a move past it) settled as that move, or
    /// the database's sweeper had expired the reservation first. A confirm is then listed as a
    /// settlement failure (`reservation_expired`), documented (docs/REDIS.md, "Reservations"):
    /// the model takes the expiry, which gives the stock back. A release settles as a
    /// duplicate of the expiry (both gave the same stock back; finding 5 in docs/TESTING.md):
    /// no failure, the database says `expired`.
    async fn resolve_late_moves(&mut self, report: &Value) -> bool {
        let late: Vec<usize> = (0..self.model.reservations.len())
            .filter(|&i| self.model.reservations[i].late_redis_move && !self.model.reservations[i].disputed)
            .collect();
        let mut warmed = false;
        let failures = report["settlement_failures"].as_array().cloned().unwrap_or_default();
        for index in late {
            let (id, state, lines) = {
                let rsv = &self.model.reservations[index];
                (rsv.id.clone(), rsv.state, rsv.lines.clone())
            };
            let (rid, qty) = lines[0];
            let key = self.model.resources[rid].key.clone();
            let p = self.live();
            let client = self.procs[p].client.clone();
            let entries = client.ledger(&key).await;
            let moves: Vec<&Value> =
                entries.iter().filter(|e| e["reservation_id"] == id.as_str() && e["op"] != "reserve").collect();
            let op = state.ledger_op().unwrap_or("");
            let move_name = if state == RsvState::Confirmed { "confirm" } else { "release" };
            let request_id = format!("{id}:{move_name}");
            let refused = failures.iter().any(|f| f["request_id"] == request_id.as_str() && f["qty"] == qty);
            match (moves.as_slice(), refused) {
                ([only], false) if only["op"] == op => self.model.reservations[index].late_redis_move = false,
                ([only], false) if only["op"] == "expire" && state == RsvState::Released => {
                    let rsv = &mut self.model.reservations[index];
                    rsv.late_redis_move = false;
                    rsv.disputed = true;
                    rsv.state = RsvState::Expired;
                    self.count("late release in Redis settled as the database's expiry (documented)");
                }
                ([only], true) if only["op"] == "expire" && state == RsvState::Confirmed => {
                    self.explained_failures.insert(request_id.clone());
                    let rsv = &mut self.model.reservations[index];
                    rsv.late_redis_move = false;
                    rsv.disputed = true;
                    rsv.state = RsvState::Expired;
                    // Redis consumed what the database gave back: Redis is short until a warm.
                    self.model.resources[rid].consumed -= qty;
                    self.count("late confirm in Redis refused by the database's expiry (documented)");
                    if self.model.resources[rid].mode == Mode::Redis {
                        self.warm(rid).await;
                        warmed = true;
                    }
                }
                _ => self.fail(format!(
                    "reservation {id} moved to {state:?} in Redis after its deadline: ledger moves {moves:?}, \
                     settlement failure {request_id}: {refused}"
                )),
            }
        }
        warmed
    }

    /// Finding 6 in docs/TESTING.md: with two processes, each settles entries of the same stream
    /// as its own consumer, so a sale made with stock a release (or expiry) had just returned to
    /// Redis can settle before that release and be refused (`insufficient`). Once everything is
    /// settled, such a failure of an acknowledged sale is counted as a known bug; the model takes
    /// the sale back as the database did (a reservation it made is no longer read or moved, and
    /// its moves' failures are explained too) and warms the resource (Redis sold it).
    async fn resolve_reordered_settlement(&mut self, report: &Value) -> bool {
        let failures = report["settlement_failures"].as_array().cloned().unwrap_or_default();
        let mut warmed = false;
        for failure in failures {
            let idempotency_key = failure["idempotency_key"].as_str().unwrap_or("").to_owned();
            let request_id = failure["request_id"].as_str().unwrap_or("").to_owned();
            if self.explained_failures.contains(&idempotency_key) || self.explained_failures.contains(&request_id) {
                continue;
            }
            // A move of a reservation already taken back: explained with it.
            if let Some(id) = request_id.split(':').next().filter(|_| request_id.contains(':')) {
                let taken_back =
                    self.model.reservations.iter().find(|r| r.id == id && r.disputed).map(|r| r.lines[0].0);
                if let Some(rid) = taken_back {
                    // Redis moved it (an expiry gives Redis back stock the database never lent).
                    self.explained_failures.insert(request_id);
                    if self.model.resources[rid].mode == Mode::Redis {
                        self.warm(rid).await;
                        warmed = true;
                    }
                    continue;
                }
            }
            let order_id = failure["order_id"].as_str().unwrap_or("").to_owned();
            let Some(position) = self.model.applied_orders.iter().position(|(id, _, _)| *id == order_id) else {
                continue;
            };
            if self.procs.len() < 2 || failure["reason"] != "insufficient" {
                continue; // not this bug: the full check fails on it
            }
            let (_, action, lines) = self.model.applied_orders.remove(position);
            let (rid, qty) = lines[0];
            match action {
                Action::Deduct => self.model.resources[rid].consumed -= qty,
                Action::Reserve => {
                    if let Some(rsv) = self.model.reservations.iter_mut().find(|r| r.order_id == order_id) {
                        if rsv.state == RsvState::Confirmed {
                            self.model.resources[rid].consumed -= qty;
                        }
                        // Neither held nor consumed in the database: not counted any more.
                        rsv.state = RsvState::Released;
                        rsv.pending = None;
                        rsv.disputed = true;
                    }
                }
            }
            self.model.outcomes.retain(|o| o.request.key != idempotency_key);
            self.explained_failures.insert(idempotency_key.clone());
            // Finding 6 (docs/TESTING.md), fixed: one process settles a stream, in order.
            self.fail(format!(
                "a sale settled before the release that gave its stock back: order {order_id} (key {idempotency_key}, {qty} of resource {rid}) refused at settlement: {failure}"
            ));
        }
        warmed
    }

    // ---------------------------------------------------------------- checks

    #[track_caller]
    fn check_invariant(&self, state: &Value) {
        let c = Counts::of(state);
        if c.available < 0 || c.reserved < 0 || c.consumed < 0 || c.available + c.reserved + c.consumed != c.total {
            self.fail(format!("counters break the invariant: {state}"));
        }
    }

    /// The cheap check after a step: the invariant, and for a db-mode resource the available
    /// stock within the model's bounds (exactly the model's counters when nothing is open).
    async fn check_resource(&mut self, rid: usize) {
        let key = self.model.resources[rid].key.clone();
        let state = self.get_json(&format!("/v1/resources/{key}")).await;
        self.check_invariant(&state);
        if self.model.resources[rid].mode == Mode::Redis {
            return; // the database lags Redis by the settlement
        }
        let now = SystemTime::now();
        let actual = Counts::of(&state);
        let (lo, hi) = self.model.bounds(rid, now);
        if !self.model.is_open(rid, now) {
            let (a, r, c, t) = self.model.certain(rid);
            if actual != Counts::new(a, r, c, t) {
                self.fail(format!(
                    "{key}: state {state}, the model holds available {a} reserved {r} consumed {c} total {t}"
                ));
            }
        } else if actual.available < lo || actual.available > hi {
            self.fail(format!("{key}: available {} outside the model's [{lo}, {hi}]: {state}", actual.available));
        }
    }

    /// Resolves everything open: pending requests and moves answered, deferred requests sent
    /// again, every short reservation out of `held`, every redis-mode resource warmed.
    async fn quiesce(&mut self) {
        self.resume_all().await;
        let deadline = tokio::time::Instant::now() + QUIESCE_DEADLINE;
        loop {
            for rid in 0..self.model.resources.len() {
                if self.model.resources[rid].mode == Mode::Redis && !self.model.resources[rid].warmed {
                    self.warm(rid).await;
                }
            }
            for request in std::mem::take(&mut self.model.pending) {
                self.retry(request).await;
            }
            for request in std::mem::take(&mut self.model.deferred) {
                let p = self.live();
                let reply = self.send(p, |c| c.keyed(&request.path, &request.key, &request.body)).await;
                let verdict = self.verdict(&request);
                self.absorb(request, reply, Some(verdict)).await;
            }
            let now = SystemTime::now();
            for index in 0..self.model.reservations.len() {
                let rsv = &self.model.reservations[index];
                if let Some(mv) = rsv.pending {
                    self.send_move(index, mv).await;
                } else if rsv.state == RsvState::Held && rsv.due(now) {
                    self.observe(index).await;
                }
            }
            let now = SystemTime::now();
            let open = !self.model.pending.is_empty()
                || !self.model.deferred.is_empty()
                || self
                    .model
                    .reservations
                    .iter()
                    .any(|r| r.pending.is_some() || (r.state == RsvState::Held && r.due(now)));
            if !open {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                self.fail(format!(
                    "still open after {QUIESCE_DEADLINE:?}: pending {:?}, deferred {:?}",
                    self.model.pending, self.model.deferred
                ));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Everything settled, then every resource exactly as the model holds it, every ledger
    /// replaying to its state and telling each order's and reservation's story once, and
    /// reconciliation clean: no drift, Redis equal to the database, nothing unsettled, no
    /// settlement failure.
    async fn full_check(&mut self, why: &str) {
        self.note(format!("full check ({why})"));
        self.quiesce().await;
        self.count("full check");
        let report = self.settle().await;
        if report["checked"] != self.model.resources.len() || report["drift"] != json!([]) {
            self.fail(format!("reconciliation: {report}"));
        }
        let unexplained: Vec<&Value> = report["settlement_failures"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|f| {
                !self.explained_failures.contains(f["idempotency_key"].as_str().unwrap_or(""))
                    && !self.explained_failures.contains(f["request_id"].as_str().unwrap_or(""))
            })
            .collect();
        if !unexplained.is_empty() {
            self.fail(format!("settlement failures no fault explains: {unexplained:?}"));
        }
        if report["redis"].as_array().into_iter().flatten().any(|e| e["warmed"] != true) {
            self.fail(format!("a redis-mode resource is not warmed: {report}"));
        }
        for rid in 0..self.model.resources.len() {
            self.check_ledger(rid).await;
        }
    }

    /// Waits until Redis has nothing left to settle and every resource shows exactly the
    /// model's counters and mode; returns the reconciliation report that showed it.
    async fn settle(&mut self) -> Value {
        // Redis may lack stock returned in the database (see `Resource::shortfall`): a warm ends it.
        for rid in 0..self.model.resources.len() {
            let resource = &self.model.resources[rid];
            if resource.mode == Mode::Redis && (resource.shortfall > 0 || resource.diverged) {
                self.warm(rid).await;
            }
        }
        let deadline = tokio::time::Instant::now() + QUIESCE_DEADLINE;
        loop {
            let report = self.get_json("/v1/reconciliation").await;
            let mut differences = Vec::new();
            let entries = report["redis"].as_array().cloned().unwrap_or_default();
            for entry in &entries {
                if entry["backlog"] != 0 || entry["unsettled"] != 0 || entry["drift"] != 0 {
                    differences.push(format!("redis {entry}"));
                }
            }
            let drained = entries.iter().all(|e| e["backlog"] == 0 && e["unsettled"] == 0);
            if drained && (self.resolve_late_moves(&report).await || self.resolve_reordered_settlement(&report).await) {
                continue; // Redis was warmed after a refused settlement: look again
            }
            for rid in 0..self.model.resources.len() {
                let key = self.model.resources[rid].key.clone();
                let state = self.get_json(&format!("/v1/resources/{key}")).await;
                let (a, r, c, t) = self.model.certain(rid);
                let mode = self.model.resources[rid].mode.name();
                if Counts::of(&state) != Counts::new(a, r, c, t) || state["mode"] != mode {
                    differences.push(format!(
                        "{key}: state {state}, the model holds available {a} reserved {r} consumed {c} total {t} mode {mode}"
                    ));
                }
            }
            // The report lists the redis-mode resources the database holds, at once (finding 3
            // in docs/TESTING.md: it used to be the answering process's view).
            let mut listed: Vec<String> = entries.iter().map(|e| e["key"].as_str().unwrap_or("").to_owned()).collect();
            listed.sort();
            let mut expected: Vec<String> =
                self.model.resources.iter().filter(|r| r.mode == Mode::Redis).map(|r| r.key.clone()).collect();
            expected.sort();
            if listed != expected {
                self.fail(format!("reconciliation lists {listed:?} in redis mode, the model {expected:?}: {report}"));
            }
            if differences.is_empty() {
                return report;
            }
            if tokio::time::Instant::now() >= deadline {
                self.fail(format!(
                    "not settled to the model after {QUIESCE_DEADLINE:?}:\n{}\n{report}",
                    differences.join("\n")
                ));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The ledger replays to the state, and holds each acknowledged order and reservation move
    /// once, and nothing of a refused order.
    async fn check_ledger(&mut self, rid: usize) {
        let key = self.model.resources[rid].key.clone();
        let p = self.live();
        let client = self.procs[p].client.clone();
        let state = self.get_json(&format!("/v1/resources/{key}")).await;
        let entries = client.ledger(&key).await;
        let replayed = std::panic::catch_unwind(|| replay_ledger(&entries));
        match replayed {
            Ok(counts) if counts == Counts::of(&state) && state["version"].as_u64() == Some(entries.len() as u64) => {}
            other => self.fail(format!(
                "{key}: ledger ({} entries, replay {other:?}) does not give the state {state}",
                entries.len()
            )),
        }
        let of_order = |order_id: &str, op: &str| -> Vec<&Value> {
            entries.iter().filter(|e| e["order_id"] == order_id && e["op"] == op).collect()
        };
        for (order_id, action, lines) in &self.model.applied_orders {
            for (line_rid, qty) in lines.iter().filter(|(r, _)| *r == rid) {
                let op = if *action == Action::Deduct { "deduct" } else { "reserve" };
                let found = of_order(order_id, op);
                if found.len() != 1 || found[0]["qty"] != *qty {
                    self.fail(format!(
                        "{key}: order {order_id} ({op} {qty} on resource {line_rid}) has ledger entries {found:?}"
                    ));
                }
            }
        }
        for order_id in &self.model.refused_orders {
            if entries.iter().any(|e| e["order_id"] == *order_id && (e["op"] == "deduct" || e["op"] == "reserve")) {
                self.fail(format!("{key}: refused order {order_id} shows in the ledger"));
            }
        }
        let known: std::collections::HashSet<&str> =
            self.model.applied_orders.iter().map(|(id, _, _)| id.as_str()).collect();
        if let Some(stray) = entries.iter().find(|e| {
            (e["op"] == "deduct" || e["op"] == "reserve") && !known.contains(e["order_id"].as_str().unwrap_or(""))
        }) {
            self.fail(format!("{key}: a ledger entry no acknowledged order explains: {stray}"));
        }
        for rsv in self.model.reservations.iter().filter(|r| !r.disputed || r.state == RsvState::Expired) {
            for (_, qty) in rsv.lines.iter().filter(|(r, _)| *r == rid) {
                let moves: Vec<&Value> =
                    entries.iter().filter(|e| e["reservation_id"] == rsv.id.as_str() && e["op"] != "reserve").collect();
                let expected_op = rsv.state.ledger_op();
                let good = match expected_op {
                    None => moves.is_empty(),
                    Some(op) => moves.len() == 1 && moves[0]["op"] == op && moves[0]["qty"] == *qty,
                };
                if !good {
                    self.fail(format!(
                        "{key}: reservation {} is {:?} in the model; its ledger moves are {moves:?}",
                        rsv.id, rsv.state
                    ));
                }
            }
        }
    }
}

/// Whether an answer is a `409` order document refused as `sold_out`, not marked as a replay.
fn answered_sold_out(reply: &Reply) -> bool {
    reply.status() == 409
        && !reply.replayed()
        && reply.content_type().starts_with("application/json")
        && reply.json()["lines"].as_array().into_iter().flatten().any(|l| l["reason"] == "sold_out")
}

fn touched_by(request: &Request) -> Vec<usize> {
    match &request.effect {
        Effect::Order { lines, .. } => lines.iter().map(|(rid, _)| *rid).collect(),
        Effect::Adjust { rid, .. } => vec![*rid],
    }
}

fn parse_time(value: &Value) -> SystemTime {
    let text = value.as_str().unwrap_or_else(|| panic!("a time is a string: {value}"));
    let time = chrono::DateTime::parse_from_rfc3339(text).unwrap_or_else(|e| panic!("{text} is RFC 3339: {e}"));
    SystemTime::from(time)
}

/// One line for the operation log.
fn brief(reply: &Result<Reply, String>) -> String {
    match reply {
        Ok(reply) => {
            let mut text = reply.text.clone();
            text.truncate(300);
            format!("{}{} {text}", reply.status(), if reply.replayed() { " (replayed)" } else { "" })
        }
        Err(e) => {
            let mut text = e.clone();
            text.truncate(120);
            format!("transport error {text}")
        }
    }
}
