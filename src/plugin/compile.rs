//! Compiling untrusted components where they cannot hurt the server: in a child process (this
//! same binary, run as `stockd __compile-plugin`) under an address-space limit, a CPU-time
//! limit, an output-size limit and a wall-clock deadline. A child
//! that exceeds any of them is killed, and the component is refused as too complex; the server
//! never allocates what the compiler does. The child writes wasmtime's precompiled artifact to
//! a private directory, and the server maps it with `Component::deserialize_file`.
//!
//! Browsers isolate untrusted content the same way; compile time and memory are not bounded by
//! a component's size (an 11 KiB component can take Cranelift 40 s and hundreds of MiB), so a
//! size limit alone is no defence.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use super::limits::InstanceShape;
use super::model::{LoadError, PluginInvalid};

/// The hidden first argument that makes `stockd` a compiler child instead of the CLI.
pub const CHILD_ARG: &str = "__compile-plugin";
/// Exit code of a child that found the component invalid (its reason is on stderr).
const EXIT_INVALID: u8 = 2;
/// Exit code of a child that could not do its job for reasons of its own (bad arguments,
/// unwritable output): a server fault, not the component's.
const EXIT_FAILED: u8 = 3;
/// Bytes of a child's stderr kept for the refusal message.
const MAX_STDERR_BYTES: u64 = 4096;
/// A compile that reached its wall-clock deadline having run for less than this share of it
/// spent it waiting for a CPU, not compiling: the machine is overloaded (`503`, retry), which
/// says nothing about the component. The child runs at the server's own priority, so it gets
/// its fair share; a lower one would starve every compile exactly when the server is busy.
const STARVED_CPU_SHARE: u32 = 4;
/// What the refusal of a component that exceeded a compile limit says.
pub const TOO_COMPLEX: &str = "the component is too complex to compile within limits";

/// How a compile is bounded (`[plugins]` settings).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileLimits {
    /// Wall-clock deadline of one compile.
    pub timeout: Duration,
    /// Address space the compiler child may map, in bytes.
    pub memory_bytes: u64,
    /// CPU time the compiler child may use (rounded up to whole seconds).
    pub cpu: Duration,
    /// Largest artifact the child may write.
    pub artifact_bytes: u64,
}

impl Default for CompileLimits {
    fn default() -> Self {
        Self {
            // The example plugins compile in 0.1-0.5 s on one core; 10 s leaves room for a large
            // honest plugin on a busy machine.
            timeout: Duration::from_secs(10),
            // The child's own mappings (binary, engine, one instance slot) take ~100 MiB; the
            // example plugins need another ~30 MiB to compile.
            memory_bytes: 512 << 20,
            cpu: Duration::from_secs(10),
            artifact_bytes: 64 << 20,
        }
    }
}

/// A compiled artifact on disk, removed when dropped (a mapping of it stays valid).
#[derive(Debug)]
pub struct Artifact {
    path: PathBuf,
}

impl Artifact {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Artifact {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Where compiles run.
enum Isolation {
    /// A child process of this program (the server binary itself).
    Child { program: PathBuf },
    /// On a blocking thread of this process: only the host's own unit tests, whose test binary
    /// cannot act as a compiler child.
    #[cfg(test)]
    InProcess,
}

/// Runs compiles in children and stops them all at shutdown.
pub struct Compiler {
    isolation: Isolation,
    limits: CompileLimits,
    /// `max_memory_bytes` and instance shape of the engine, so the child builds an engine the
    /// artifact fits.
    engine_memory_bytes: usize,
    engine_shape: InstanceShape,
    dir: tempfile::TempDir,
    next_file: AtomicU64,
    stop: watch::Sender<bool>,
}

impl Compiler {
    /// A compiler whose children run this very executable: `/proc/self/exe`, the running
    /// binary's own file even after an upgrade replaced or deleted it on disk, so a child's
    /// artifact always matches this process's wasmtime.
    pub fn new(
        limits: CompileLimits,
        engine_memory_bytes: usize,
        engine_shape: InstanceShape,
    ) -> anyhow::Result<Compiler> {
        let program = PathBuf::from("/proc/self/exe");
        anyhow::ensure!(program.exists(), "/proc/self/exe is missing: plugin compiles need Linux with /proc mounted");
        Self::with_isolation(Isolation::Child { program }, limits, engine_memory_bytes, engine_shape)
    }

    #[cfg(test)]
    pub fn in_process(
        limits: CompileLimits,
        engine_memory_bytes: usize,
        engine_shape: InstanceShape,
    ) -> anyhow::Result<Compiler> {
        Self::with_isolation(Isolation::InProcess, limits, engine_memory_bytes, engine_shape)
    }

    fn with_isolation(
        isolation: Isolation,
        limits: CompileLimits,
        engine_memory_bytes: usize,
        engine_shape: InstanceShape,
    ) -> anyhow::Result<Self> {
        // Private to this user (0700): only this process and its children write here.
        let dir = tempfile::Builder::new()
            .prefix("stockd-compile-")
            .tempdir()
            .map_err(|e| anyhow::anyhow!("creating a directory for compiled plugins: {e}"))?;
        Ok(Compiler {
            isolation,
            limits,
            engine_memory_bytes,
            engine_shape,
            dir,
            next_file: AtomicU64::new(0),
            stop: watch::Sender::new(false),
        })
    }

    pub fn limits(&self) -> &CompileLimits {
        &self.limits
    }

    /// Kills every compile in progress and refuses new ones (`Unavailable`): shutdown.
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }

    /// Compiles `wasm` into an artifact the host's engine can load. Cancel-safe: dropping the
    /// future kills the child.
    pub async fn compile(&self, wasm: &[u8]) -> Result<Artifact, LoadError> {
        let mut stop = self.stop.subscribe();
        if *stop.borrow_and_update() {
            return Err(LoadError::Unavailable("the server is shutting down".into()));
        }
        let n = self.next_file.fetch_add(1, Ordering::Relaxed);
        let artifact = Artifact { path: self.dir.path().join(format!("{n}.cwasm")) };
        match &self.isolation {
            Isolation::Child { program } => {
                let outcome = tokio::select! {
                    outcome = self.run_child(program, wasm, artifact.path()) => outcome,
                    _ = stop.changed() => Err(LoadError::Unavailable("the server is shutting down".into())),
                };
                outcome?;
            }
            #[cfg(test)]
            Isolation::InProcess => {
                let engine =
                    wasmtime::Engine::new(&super::host::engine_config(self.engine_memory_bytes, self.engine_shape, 1))
                        .map_err(|e| LoadError::Unavailable(format!("plugin engine: {e}")))?;
                let bytes = engine.precompile_component(wasm).map_err(|e| {
                    PluginInvalid::new(format!("the component does not compile: {}", super::host::short_error(&e)))
                })?;
                std::fs::write(artifact.path(), bytes).map_err(|e| LoadError::Unavailable(e.to_string()))?;
            }
        }
        Ok(artifact)
    }

    async fn run_child(&self, program: &Path, wasm: &[u8], out: &Path) -> Result<(), LoadError> {
        let limits = &self.limits;
        let memory_bytes = limits.memory_bytes as libc::rlim_t;
        let cpu_seconds = limits.cpu.as_millis().div_ceil(1000).max(1) as libc::rlim_t;
        let artifact_bytes = limits.artifact_bytes as libc::rlim_t;
        let mut command = tokio::process::Command::new(program);
        command
            .arg(CHILD_ARG)
            .arg(self.engine_memory_bytes.to_string())
            .arg(shape_arg(self.engine_shape))
            .arg(out)
            // The child needs nothing from the server's environment (which may hold secrets).
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe system calls (setrlimit, prctl, getppid, kill).
        unsafe {
            command.pre_exec(move || {
                set_limit(libc::RLIMIT_AS, memory_bytes)?;
                // SIGXCPU at the soft limit; the hard limit one second later is SIGKILL.
                set_limits(libc::RLIMIT_CPU, cpu_seconds, cpu_seconds + 1)?;
                set_limit(libc::RLIMIT_FSIZE, artifact_bytes)?;
                set_limit(libc::RLIMIT_CORE, 0)?;
                // Dies with the server, even when the server is killed with SIGKILL.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 || libc::getppid() == 1 {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
                Ok(())
            });
        }
        let mut child =
            command.spawn().map_err(|e| LoadError::Unavailable(format!("could not start the plugin compiler: {e}")))?;
        metrics::gauge!("stockd_plugin_compiles_running").increment(1.0);
        let _running = scopeguard(|| metrics::gauge!("stockd_plugin_compiles_running").decrement(1.0));

        let pid = child.id();
        let mut stdin = child.stdin.take();
        let mut stderr = child.stderr.take();
        let work = async {
            if let Some(stdin) = stdin.as_mut() {
                // A child that died early closes the pipe; its exit status says why.
                let _ = stdin.write_all(wasm).await;
            }
            drop(stdin.take());
            let mut message = Vec::new();
            if let Some(stderr) = stderr.as_mut() {
                let _ = stderr.take(MAX_STDERR_BYTES).read_to_end(&mut message).await;
            }
            (child.wait().await, message)
        };
        let (status, message) = match tokio::time::timeout(limits.timeout, work).await {
            Ok(done) => done,
            Err(_) => {
                // `child` is dropped on return: kill_on_drop kills it and the runtime reaps it.
                // A compile that spent its deadline mostly waiting for a CPU says the machine is
                // overloaded, not that the component is too complex: retry later.
                let cpu = pid.and_then(process_cpu_time).unwrap_or(limits.timeout);
                if cpu < limits.timeout / STARVED_CPU_SHARE {
                    return Err(LoadError::Unavailable(
                        "the server is too busy to compile the plugin now; try again".into(),
                    ));
                }
                return Err(too_complex(format!("it did not compile within {} ms", limits.timeout.as_millis())));
            }
        };
        let status = status.map_err(|e| LoadError::Unavailable(format!("waiting for the plugin compiler: {e}")))?;
        let message = String::from_utf8_lossy(&message).trim().to_string();
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(0), _) => Ok(()),
            (Some(code), _) if code == i32::from(EXIT_INVALID) => {
                Err(PluginInvalid::new(format!("the component does not compile: {message}")).into())
            }
            (Some(code), _) if code == i32::from(EXIT_FAILED) => {
                tracing::error!(%message, "the plugin compiler failed");
                Err(LoadError::Unavailable("the plugin compiler failed; try again".into()))
            }
            // Killed by a limit (SIGKILL, SIGXCPU, SIGXFSZ), or aborted on a failed allocation
            // under the address-space limit (SIGABRT, or an allocation-failure exit).
            (_, Some(signal)) => Err(too_complex(format!("the compiler was stopped ({})", signal_name(signal)))),
            (Some(code), None) => Err(too_complex(format!("the compiler exited with code {code}"))),
            (None, None) => Err(too_complex("the compiler was stopped".into())),
        }
    }
}

fn too_complex(why: String) -> LoadError {
    metrics::counter!("stockd_plugin_compile_limit_hits_total").increment(1);
    LoadError::Invalid(PluginInvalid::new(format!("{TOO_COMPLEX}: {why}")))
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGKILL => "killed: memory, CPU time or deadline",
        libc::SIGXCPU => "CPU time limit",
        libc::SIGXFSZ => "output size limit",
        libc::SIGABRT => "out of memory",
        libc::SIGSEGV => "out of memory or stack",
        _ => "signal",
    }
}

/// CPU time (user and system) a live process has used, from `/proc/PID/stat`.
fn process_cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; the fields after its closing parenthesis
    // start at field 3, so utime and stime (fields 14 and 15) are the 12th and 13th there.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let ticks: u64 = fields.next()?.parse::<u64>().ok()? + fields.next()?.parse::<u64>().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let per_second = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok().filter(|t| *t > 0)?;
    Some(Duration::from_millis(ticks.saturating_mul(1000) / per_second))
}

fn set_limit(resource: libc::__rlimit_resource_t, value: libc::rlim_t) -> std::io::Result<()> {
    set_limits(resource, value, value)
}

fn set_limits(resource: libc::__rlimit_resource_t, soft: libc::rlim_t, hard: libc::rlim_t) -> std::io::Result<()> {
    let limit = libc::rlimit { rlim_cur: soft, rlim_max: hard };
    // SAFETY: `limit` is a valid rlimit for the duration of the call.
    if unsafe { libc::setrlimit(resource, &limit) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Runs `f` when dropped.
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

/// The engine's instance shape as one argument: `CORE_INSTANCES,MEMORIES,TABLES,TABLE_ELEMENTS`.
fn shape_arg(shape: InstanceShape) -> String {
    format!("{},{},{},{}", shape.core_instances, shape.memories, shape.tables, shape.table_elements)
}

fn parse_shape_arg(arg: &str) -> Option<InstanceShape> {
    let mut parts = arg.split(',');
    let shape = InstanceShape {
        core_instances: parts.next()?.parse().ok()?,
        memories: parts.next()?.parse().ok()?,
        tables: parts.next()?.parse().ok()?,
        table_elements: parts.next()?.parse().ok()?,
    };
    parts.next().is_none().then_some(shape)
}

/// The child's side: `stockd __compile-plugin ENGINE_MEMORY_BYTES SHAPE OUT_PATH`, the
/// component on stdin. Returns `None` when this process was not started as a compiler child.
/// Runs before any runtime or thread starts, so the limits the parent set bound all of it.
pub fn child_main_if_requested() -> Option<ExitCode> {
    let mut args = std::env::args_os().skip(1);
    if args.next()? != CHILD_ARG {
        return None;
    }
    let engine_memory_bytes = args.next().and_then(|a| a.to_str()?.parse::<usize>().ok());
    let shape = args.next().and_then(|a| parse_shape_arg(a.to_str()?));
    let out = args.next().map(PathBuf::from);
    let (Some(engine_memory_bytes), Some(shape), Some(out)) = (engine_memory_bytes, shape, out) else {
        eprintln!("usage: stockd {CHILD_ARG} ENGINE_MEMORY_BYTES CORE_INSTANCES,MEMORIES,TABLES,TABLE_ELEMENTS OUT_PATH < component.wasm");
        return Some(ExitCode::from(EXIT_FAILED));
    };
    Some(child_compile(engine_memory_bytes, shape, &out))
}

fn child_compile(engine_memory_bytes: usize, shape: InstanceShape, out: &Path) -> ExitCode {
    let mut wasm = Vec::new();
    if let Err(e) = std::io::stdin().lock().read_to_end(&mut wasm) {
        eprintln!("reading the component: {e}");
        return ExitCode::from(EXIT_FAILED);
    }
    // One instance slot: the artifact depends on the engine's settings, not its pool size.
    let engine = match wasmtime::Engine::new(&super::host::engine_config(engine_memory_bytes, shape, 1)) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("plugin engine: {e}");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    let artifact = match engine.precompile_component(&wasm) {
        Ok(artifact) => artifact,
        Err(e) => {
            eprintln!("{}", super::host::short_error(&e));
            return ExitCode::from(EXIT_INVALID);
        }
    };
    let written = std::fs::File::create_new(out).and_then(|mut file| file.write_all(&artifact));
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("writing the artifact: {e}");
            ExitCode::from(EXIT_FAILED)
        }
    }
}
