//! Supervision of the background jobs: every job runs under a [`Supervisor`], which catches a
//! panic (logged, counted in `stockd_job_panics_total{job}`), waits a short backoff and starts
//! the job again, and stops every job on shutdown. Each job reports its successful runs to its
//! entry in the [`JobRegistry`]; `/readyz` lists the entries and answers 503 while one of them
//! is stuck: no successful run for longer than its threshold (see [`StuckPolicy`]); a run that
//! failed only because an external receiver did ([`Tick::ReceiverDown`]) does not count
//! against it.
//!
//! A supervisor cannot take back a job that hangs (dropping its future mid-statement is no
//! better than waiting); it makes the hang visible instead.
//!
//! Test hooks ([`faults`]): `STOCKD_FAULT_PANIC_JOB=name:count` makes the named job panic on
//! its first `count` runs, `STOCKD_FAULT_HANG_JOB=name:ms` makes its first run hang `ms`
//! milliseconds, `STOCKD_FAULT_HANG_AT=point` makes a job hang for good at a named point of its
//! run. All are read once, at the first use, and logged as a warning when set.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// First wait before a panicked job starts again; doubles with each panic in a row.
const RESTART_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest wait before a panicked job starts again.
const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// First wait before a periodic job whose run failed (storage down) tries again, doubling up to
/// its interval: a job with a long interval catches up soon after the database is back.
const RETRY_BACKOFF_MIN: Duration = Duration::from_secs(1);

/// When a job counts as stuck: after `max(intervals × its interval, min)` without a successful
/// run. Settings `[jobs] stuck_after_intervals` and `stuck_min_ms`.
#[derive(Debug, Clone, Copy)]
pub struct StuckPolicy {
    pub intervals: u32,
    pub min: Duration,
}

impl StuckPolicy {
    /// The threshold of a job that should succeed every `interval`.
    pub fn threshold(&self, interval: Duration) -> Duration {
        interval.saturating_mul(self.intervals).max(self.min)
    }
}

/// How one periodic run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tick {
    /// The run did its work (possibly none was due).
    Done,
    /// The run failed (already logged); it is tried again after a backoff.
    Failed,
    /// The run reached storage but an external receiver (a broker) failed it (already logged
    /// and counted): tried again after a backoff like `Failed`, but the job is not stuck for it.
    /// `/readyz` routes traffic around a process that cannot serve; every process shares the
    /// receiver, so none would serve better, and the receiver's own metrics tell the operator.
    ReceiverDown,
}

/// One job's health, shared by the job (which reports successes) and `/readyz`.
#[derive(Debug)]
pub struct JobHealth {
    name: &'static str,
    /// `None`: the job waits for events and is never stuck (the sold-out listener).
    stuck_after: Option<Duration>,
    registered: Instant,
    /// Milliseconds after `registered` of the last success, plus one (0: never).
    last_ok: AtomicU64,
    /// Like `last_ok`, for the last run that ended without being stuck on this process: a
    /// success, or a failure of an external receiver ([`Tick::ReceiverDown`]).
    last_alive: AtomicU64,
    restarts: AtomicU64,
}

impl JobHealth {
    /// Records a successful run now.
    pub fn ok(&self) {
        let since = self.since_registered();
        self.last_ok.store(since, Ordering::Relaxed);
        self.last_alive.store(since, Ordering::Relaxed);
    }

    /// Records a run that failed on an external receiver now: not a success, not stuck.
    pub fn alive(&self) {
        self.last_alive.store(self.since_registered(), Ordering::Relaxed);
    }

    /// Milliseconds since registration, plus one (the encoding of `last_ok`).
    fn since_registered(&self) -> u64 {
        u64::try_from(self.registered.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1
    }

    fn report(&self) -> JobReport {
        let now_ms = u64::try_from(self.registered.elapsed().as_millis()).unwrap_or(u64::MAX);
        let last_ok = self.last_ok.load(Ordering::Relaxed);
        let last_ok_ms_ago = (last_ok > 0).then(|| now_ms.saturating_sub(last_ok - 1));
        let last_alive = self.last_alive.load(Ordering::Relaxed).max(last_ok);
        // A job that never ran to an end is judged from when it was started.
        let quiet_ms = if last_alive > 0 { now_ms.saturating_sub(last_alive - 1) } else { now_ms };
        let stuck_after_ms = self.stuck_after.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        JobReport {
            name: self.name,
            last_ok_ms_ago,
            restarts: self.restarts.load(Ordering::Relaxed),
            stuck_after_ms,
            stuck: stuck_after_ms.is_some_and(|limit| quiet_ms > limit),
        }
    }
}

/// What `/readyz` shows of one job.
#[derive(Debug, Clone, Serialize)]
pub struct JobReport {
    #[serde(skip)]
    pub name: &'static str,
    /// Milliseconds since its last successful run; `null` before the first.
    pub last_ok_ms_ago: Option<u64>,
    /// How often it panicked and was started again.
    pub restarts: u64,
    /// Without a success for longer than this, it is stuck; `null`: never (event-driven).
    pub stuck_after_ms: Option<u64>,
    pub stuck: bool,
}

/// Every supervised job of the process, for `/readyz`.
#[derive(Debug, Default)]
pub struct JobRegistry {
    jobs: Mutex<Vec<Arc<JobHealth>>>,
}

impl JobRegistry {
    fn register(&self, name: &'static str, stuck_after: Option<Duration>) -> Arc<JobHealth> {
        let health = Arc::new(JobHealth {
            name,
            stuck_after,
            registered: Instant::now(),
            last_ok: AtomicU64::new(0),
            last_alive: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
        });
        if let Ok(mut jobs) = self.jobs.lock() {
            jobs.push(health.clone());
        }
        health
    }

    /// Every job's report, in the order they were started.
    pub fn report(&self) -> Vec<JobReport> {
        self.jobs.lock().map(|jobs| jobs.iter().map(|j| j.report()).collect()).unwrap_or_default()
    }
}

/// What a running job gets: where to report success, the shutdown signal, and the fault hook.
#[derive(Clone)]
pub struct JobCtx {
    health: Arc<JobHealth>,
    shutdown: watch::Receiver<bool>,
}

impl JobCtx {
    /// Records a successful run now.
    pub fn ok(&self) {
        self.health.ok();
    }

    /// The shutdown signal; the job returns once it turns true.
    pub fn shutdown(&self) -> watch::Receiver<bool> {
        self.shutdown.clone()
    }

    /// Applies the test hook configured for this job, if any: panics, or hangs. Called at the
    /// start of every run.
    pub async fn fault_point(&self) {
        faults::before_run(self.health.name).await;
    }
}

/// Starts jobs, restarts them after a panic, stops them on shutdown.
pub struct Supervisor {
    registry: Arc<JobRegistry>,
    policy: StuckPolicy,
    shutdown: watch::Receiver<bool>,
    handles: Vec<JoinHandle<()>>,
}

impl Supervisor {
    pub fn new(registry: Arc<JobRegistry>, policy: StuckPolicy, shutdown: watch::Receiver<bool>) -> Self {
        Self { registry, policy, shutdown, handles: Vec::new() }
    }

    /// Runs `tick` every `interval` (a failed run is retried sooner, see [`RETRY_BACKOFF_MIN`]);
    /// the job is stuck after the policy's threshold without a [`Tick::Done`].
    pub fn every<F, Fut>(&mut self, name: &'static str, interval: Duration, tick: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Tick> + Send + 'static,
    {
        let tick = Arc::new(tick);
        let threshold = self.policy.threshold(interval);
        self.spawn(name, Some(threshold), move |ctx| periodic(interval, ctx, tick.clone()));
    }

    /// Runs a job that loops on its own until shutdown (it calls [`JobCtx::ok`] as it makes
    /// progress, and [`JobCtx::fault_point`] at each pass). `interval` is how often it should
    /// succeed at least (`None`: an event-driven job, never stuck).
    pub fn run<F, Fut>(&mut self, name: &'static str, interval: Option<Duration>, job: F)
    where
        F: Fn(JobCtx) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let stuck_after = interval.map(|i| self.policy.threshold(i));
        self.spawn(name, stuck_after, job);
    }

    fn spawn<F, Fut>(&mut self, name: &'static str, stuck_after: Option<Duration>, job: F)
    where
        F: Fn(JobCtx) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let health = self.registry.register(name, stuck_after);
        let ctx = JobCtx { health, shutdown: self.shutdown.clone() };
        self.handles.push(tokio::spawn(supervise(name, ctx, job)));
    }

    /// Waits for every job to return (after the shutdown signal turned true).
    pub async fn join(self) {
        for handle in self.handles {
            let _ = handle.await;
        }
    }
}

/// Runs incarnations of `job` until one returns (shutdown), starting a new one after each panic.
async fn supervise<F, Fut>(name: &'static str, ctx: JobCtx, job: F)
where
    F: Fn(JobCtx) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut shutdown = ctx.shutdown.clone();
    let mut panics_in_a_row: u32 = 0;
    let mut last_ok = ctx.health.last_ok.load(Ordering::Relaxed);
    loop {
        // A panic can leave nothing the next incarnation relies on: each builds its own state
        // from the shared handles it captured (storage, Redis), which a panic does not corrupt.
        let ran = AssertUnwindSafe(job(ctx.clone())).catch_unwind().await;
        let Err(panic) = ran else { return };
        let reason = panic_message(panic.as_ref());
        ctx.health.restarts.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("stockd_job_panics_total", "job" => name).increment(1);
        let now_ok = ctx.health.last_ok.load(Ordering::Relaxed);
        panics_in_a_row = if now_ok != last_ok { 1 } else { panics_in_a_row.saturating_add(1) };
        last_ok = now_ok;
        let backoff =
            RESTART_BACKOFF_MIN.saturating_mul(1 << panics_in_a_row.saturating_sub(1).min(16)).min(RESTART_BACKOFF_MAX);
        tracing::error!(job = name, panic = %reason, restart_in_ms = backoff.as_millis() as u64, "background job panicked; restarting it");
        if *shutdown.borrow() {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// The loop of a periodic job: a run every `interval`, sooner after a failed one.
async fn periodic<F, Fut>(interval: Duration, ctx: JobCtx, tick: Arc<F>)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Tick>,
{
    let mut shutdown = ctx.shutdown();
    let mut timer = tokio::time::interval(interval);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut retry = RETRY_BACKOFF_MIN;
    loop {
        tokio::select! {
            _ = timer.tick() => {}
            _ = shutdown.changed() => return,
        }
        // A run that hangs must not hold up shutdown. Dropping it is safe: each run is one or
        // more whole transactions handed to the writer, which commits or not regardless.
        let run = async {
            ctx.fault_point().await;
            tick().await
        };
        let ended = tokio::select! {
            ended = run => ended,
            _ = shutdown.changed() => return,
        };
        match ended {
            Tick::Done => {
                ctx.ok();
                retry = RETRY_BACKOFF_MIN;
            }
            Tick::Failed | Tick::ReceiverDown => {
                if ended == Tick::ReceiverDown {
                    ctx.health.alive();
                }
                if retry < interval {
                    timer.reset_after(retry);
                    retry = retry.saturating_mul(2);
                }
            }
        }
        if *shutdown.borrow() {
            return;
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

/// Failure injection for the black-box tests, which can only reach the server through its
/// environment: `STOCKD_FAULT_PANIC_JOB=name:count[,name:count]` panics the named job's first
/// `count` runs (the SQLite writer's first `count` batches for `sqlite_writer`);
/// `STOCKD_FAULT_HANG_JOB=name:ms[,...]` makes its first run hang `ms` milliseconds;
/// `STOCKD_FAULT_HANG_AT=point[,...]` hangs at those points ([`hang_at`]) until killed. Unset (as in
/// any real deployment) they cost one relaxed atomic load per run.
pub mod faults {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    use std::time::Duration;

    #[derive(Default)]
    struct Faults {
        /// Runs left to panic, by job.
        panics: HashMap<String, AtomicU64>,
        /// Milliseconds the next run hangs (taken once), by job.
        hangs: HashMap<String, AtomicU64>,
        /// Points inside a job's run where it hangs until the process is killed.
        hang_at: Vec<String>,
    }

    fn faults() -> &'static Faults {
        static FAULTS: OnceLock<Faults> = OnceLock::new();
        FAULTS.get_or_init(|| {
            let faults = Faults {
                panics: parse(std::env::var("STOCKD_FAULT_PANIC_JOB").ok().as_deref()),
                hangs: parse(std::env::var("STOCKD_FAULT_HANG_JOB").ok().as_deref()),
                hang_at: std::env::var("STOCKD_FAULT_HANG_AT")
                    .unwrap_or_default()
                    .split(',')
                    .map(|p| p.trim().to_string())
                    .filter(|p| !p.is_empty())
                    .collect(),
            };
            if !faults.panics.is_empty() || !faults.hangs.is_empty() || !faults.hang_at.is_empty() {
                tracing::warn!("STOCKD_FAULT_* test hooks are set: jobs will panic or hang on purpose");
            }
            faults
        })
    }

    fn parse(spec: Option<&str>) -> HashMap<String, AtomicU64> {
        spec.unwrap_or_default()
            .split(',')
            .filter_map(|item| {
                let (name, n) = item.trim().split_once(':')?;
                Some((name.to_string(), AtomicU64::new(n.parse().ok()?)))
            })
            .collect()
    }

    fn take_one(counter: Option<&AtomicU64>) -> bool {
        counter.is_some_and(|c| c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok())
    }

    /// Panics if the job `name` still has injected panics left.
    pub fn maybe_panic(name: &str) {
        if take_one(faults().panics.get(name)) {
            panic!("injected fault: STOCKD_FAULT_PANIC_JOB for {name}");
        }
    }

    /// Hangs for good if `STOCKD_FAULT_HANG_AT` names `point`: a crash test kills the process
    /// there (`nats_sink.before_cursor`: the sink's page is acknowledged, its cursor not stored).
    pub async fn hang_at(point: &str) {
        if faults().hang_at.iter().any(|p| p == point) {
            tracing::warn!(point, "injected fault: STOCKD_FAULT_HANG_AT; hanging until killed");
            std::future::pending::<()>().await;
        }
    }

    /// The hook at the start of a job's run: a hang, then a panic, if injected.
    pub async fn before_run(name: &str) {
        let hang_ms = faults().hangs.get(name).map(|ms| ms.swap(0, Ordering::Relaxed)).unwrap_or(0);
        if hang_ms > 0 {
            tracing::warn!(job = name, hang_ms, "injected fault: STOCKD_FAULT_HANG_JOB");
            tokio::time::sleep(Duration::from_millis(hang_ms)).await;
        }
        maybe_panic(name);
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn specs_parse_and_count_down() {
            let panics = parse(Some("expiry:2, purge:1,bad,x:y"));
            assert_eq!(panics.len(), 2);
            assert!(take_one(panics.get("expiry")));
            assert!(take_one(panics.get("expiry")));
            assert!(!take_one(panics.get("expiry")));
            assert!(!take_one(panics.get("reconcile")));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_is_a_multiple_of_the_interval_with_a_floor() {
        let policy = StuckPolicy { intervals: 10, min: Duration::from_secs(30) };
        assert_eq!(policy.threshold(Duration::from_secs(1)), Duration::from_secs(30));
        assert_eq!(policy.threshold(Duration::from_secs(60)), Duration::from_secs(600));
    }

    /// A job whose external receiver is down is retried and never stuck (nor reported as
    /// successful); a job whose runs fail is stuck past its threshold.
    #[tokio::test]
    async fn a_receiver_outage_is_not_stuck_but_failed_runs_are() {
        let registry = Arc::new(JobRegistry::default());
        let (stop, stopped) = watch::channel(false);
        // Threshold: 200 x 5 ms = 1 s.
        let policy = StuckPolicy { intervals: 200, min: Duration::ZERO };
        let mut supervisor = Supervisor::new(registry.clone(), policy, stopped);
        let runs = Arc::new(AtomicU64::new(0));
        let counted = runs.clone();
        supervisor.every("sink", Duration::from_millis(5), move || {
            counted.fetch_add(1, Ordering::Relaxed);
            async { Tick::ReceiverDown }
        });
        supervisor.every("failing", Duration::from_millis(5), || async { Tick::Failed });
        let deadline = Instant::now() + Duration::from_secs(10);
        while !registry.report()[1].stuck {
            assert!(Instant::now() < deadline, "the failing job never became stuck: {:?}", registry.report());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let sink = &registry.report()[0];
        assert!(!sink.stuck, "{sink:?}");
        assert_eq!(sink.last_ok_ms_ago, None, "a receiver outage is no success");
        assert!(runs.load(Ordering::Relaxed) > 1, "the sink was retried");
        let _ = stop.send(true);
        supervisor.join().await;
    }

    /// A job that panics is started again, counted, and keeps reporting successes.
    #[tokio::test]
    async fn a_panicking_job_is_restarted() {
        let registry = Arc::new(JobRegistry::default());
        let (stop, stopped) = watch::channel(false);
        let mut supervisor =
            Supervisor::new(registry.clone(), StuckPolicy { intervals: 10, min: Duration::ZERO }, stopped);
        let runs = Arc::new(AtomicU64::new(0));
        let counted = runs.clone();
        supervisor.every("flaky", Duration::from_millis(5), move || {
            let n = counted.fetch_add(1, Ordering::Relaxed);
            async move {
                assert!(n >= 2, "the first two runs panic");
                Tick::Done
            }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while registry.report()[0].last_ok_ms_ago.is_none() {
            assert!(Instant::now() < deadline, "the job never succeeded: {:?}", registry.report());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(registry.report()[0].restarts, 2);
        let _ = stop.send(true);
        supervisor.join().await;
    }
}
