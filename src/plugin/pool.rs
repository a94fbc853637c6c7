//! The plan pool: a fixed set of threads on which every plugin call runs. Plugin code is
//! untrusted and CPU-bound, so it never runs on the async runtime's workers (where one
//! tenant's expensive plugin would stall every tenant's requests); a tenant's calls can occupy
//! at most its share of the pool's threads, so of the machine's cores. The threads may also
//! run at a lower scheduling priority (`plan_thread_nice`).
//!
//! Admission is fair by construction: a tenant holds at most `max_concurrent_plans_per_tenant`
//! of the pool's places (a place is a call queued for or running on a thread; the pool has a
//! place per thread), and places are handed out first come, first served. A call that cannot get its tenant's place within `plan_wait` is the tenant's own
//! excess (`429`); one that cannot get a pool place is the server's (`503`). Both are answers
//! to retry, never a plugin failure.

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{oneshot, Semaphore};

use crate::engine::TenantId;

/// Tenants whose place counters are remembered; idle ones are forgotten beyond this.
const MAX_TRACKED_TENANTS: usize = 10_000;

type Job = Box<dyn FnOnce() + Send>;

/// How the pool is sized and shared (`[plugins]` settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSettings {
    /// Threads running plugin calls.
    pub threads: usize,
    /// Places (waiting or running) one tenant may hold at once.
    pub per_tenant: usize,
    /// How long a call may wait for a place before it is answered `429` or `503`.
    pub wait: Duration,
    /// Niceness of the pool's threads (0: the server's own priority; 10: a busy plugin gets
    /// about a tenth of a core the server's threads want). Above 0, plugin calls of every
    /// tenant wait longest exactly when the machine is saturated.
    pub nice: i32,
}

impl PoolSettings {
    /// The settings, where 0 `threads` means one per core (at least two) and 0 `per_tenant`
    /// half of the threads (at least one).
    pub fn resolve(threads: usize, per_tenant: usize, wait: Duration, nice: i32) -> PoolSettings {
        let threads =
            if threads == 0 { std::thread::available_parallelism().map_or(2, |n| n.get()).max(2) } else { threads };
        let per_tenant = if per_tenant == 0 { (threads / 2).max(1) } else { per_tenant };
        PoolSettings { threads, per_tenant, wait, nice }
    }
}

/// Why a call did not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The tenant already uses all its places: its own excess (`429`).
    #[error("too many plugin calls of this tenant at once; retry shortly")]
    TenantBusy,
    /// Every place of the pool is taken (`503`).
    #[error("every plugin thread is busy; retry shortly")]
    Exhausted,
}

impl PoolError {
    /// A stable, low-cardinality name for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            PoolError::TenantBusy => "tenant_busy",
            PoolError::Exhausted => "exhausted",
        }
    }
}

/// The pool. One per process.
pub struct PlanPool {
    jobs: mpsc::SyncSender<Job>,
    places: Arc<Semaphore>,
    tenants: Mutex<HashMap<TenantId, Arc<Semaphore>>>,
    settings: PoolSettings,
}

impl PlanPool {
    /// Starts the pool's threads. They live as long as the process (they sleep when idle).
    pub fn new(settings: PoolSettings) -> anyhow::Result<PlanPool> {
        anyhow::ensure!(settings.threads >= 1, "plugins.plan_threads must be at least 1");
        anyhow::ensure!(settings.per_tenant >= 1, "plugins.max_concurrent_plans_per_tenant must be at least 1");
        // Never more queued than places: `run` holds a place for every job it sends.
        let (jobs, queue) = mpsc::sync_channel::<Job>(settings.threads);
        let queue = Arc::new(Mutex::new(queue));
        anyhow::ensure!((0..=19).contains(&settings.nice), "plugins.plan_thread_nice must be between 0 and 19");
        for n in 0..settings.threads {
            let queue = Arc::clone(&queue);
            let nice = settings.nice;
            std::thread::Builder::new()
                .name(format!("stockd-plan-{n}"))
                .spawn(move || work(&queue, nice))
                .map_err(|e| anyhow::anyhow!("starting plan thread {n}: {e}"))?;
        }
        Ok(PlanPool { jobs, places: Arc::new(Semaphore::new(settings.threads)), tenants: Mutex::default(), settings })
    }

    /// Runs `job` for `tenant` on a pool thread and returns its result. If the caller goes
    /// away, the job still finishes (it is bounded by the plugin's fuel and deadline) and
    /// holds its places until then, so the accounting never undercounts.
    pub async fn run<R: Send + 'static>(
        &self,
        tenant: &TenantId,
        job: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, PoolError> {
        let deadline = tokio::time::Instant::now() + self.settings.wait;
        let tenant_place = tokio::time::timeout_at(deadline, self.tenant_places(tenant).acquire_owned())
            .await
            .map_err(|_| PoolError::TenantBusy)?
            .map_err(|_| PoolError::Exhausted)?;
        let place = tokio::time::timeout_at(deadline, Arc::clone(&self.places).acquire_owned())
            .await
            .map_err(|_| PoolError::Exhausted)?
            .map_err(|_| PoolError::Exhausted)?;
        let (done, result) = oneshot::channel();
        let job: Job = Box::new(move || {
            metrics::gauge!("stockd_plan_calls_running").increment(1.0);
            let output = job();
            metrics::gauge!("stockd_plan_calls_running").decrement(1.0);
            drop(place);
            drop(tenant_place);
            let _ = done.send(output);
        });
        self.jobs.try_send(job).map_err(|_| PoolError::Exhausted)?;
        // An error here means the job panicked (its thread caught it and lives on).
        result.await.map_err(|_| PoolError::Exhausted)
    }

    fn tenant_places(&self, tenant: &TenantId) -> Arc<Semaphore> {
        let mut tenants = self.tenants.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(places) = tenants.get(tenant) {
            return Arc::clone(places);
        }
        if tenants.len() >= MAX_TRACKED_TENANTS {
            // Only counters nobody holds (no call waiting or running) can go.
            tenants.retain(|_, places| Arc::strong_count(places) > 1);
        }
        let places = Arc::new(Semaphore::new(self.settings.per_tenant));
        tenants.insert(tenant.clone(), Arc::clone(&places));
        places
    }
}

/// A pool thread: sets its own priority, then runs jobs until the pool is gone.
fn work(queue: &Mutex<mpsc::Receiver<Job>>, nice: i32) {
    if nice > 0 {
        // SAFETY: plain system calls on this thread's own id. Failing to lower the priority
        // leaves the thread at the server's priority, which is still correct, only less fair.
        unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice);
        }
    }
    loop {
        let job = match queue.lock().unwrap_or_else(PoisonError::into_inner).recv() {
            Ok(job) => job,
            Err(_) => return,
        };
        // A panic in a job (a host bug; plugins trap, they cannot panic the host) must not
        // take the thread with it. Its caller sees the dropped result channel.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
    }
}
