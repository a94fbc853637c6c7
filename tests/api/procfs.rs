//! What a test can see of the server process from outside, through Linux's `/proc`: its
//! resident memory, its CPU time, and its child processes with their command lines. Reading
//! another process's `/proc` files never disturbs it, so these observe a black box.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often a watch samples the process.
const SAMPLE_INTERVAL: Duration = Duration::from_millis(10);
/// Clock ticks per second of `/proc/PID/stat`'s CPU times (`USER_HZ`, 100 on every Linux
/// architecture tests run on).
const TICKS_PER_SECOND: u64 = 100;

/// The process's resident memory (`VmRSS`) in bytes, or `None` once it is gone.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The process's CPU time so far (user + system) in milliseconds, or `None` once it is gone.
pub fn cpu_ms(pid: u32) -> Option<u64> {
    let fields = stat_fields(pid)?;
    // Fields 14 and 15 of `stat` (1-based); `stat_fields` starts after the command, at field 3.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) * 1000 / TICKS_PER_SECOND)
}

/// A running (not zombie) direct child of `pid`, with its command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildProcess {
    pub pid: u32,
    /// The arguments, joined by spaces.
    pub cmdline: String,
}

/// The running direct children of `pid`. Scans every process's parent id, because not every
/// kernel has `/proc/PID/task/TID/children`.
pub fn children(pid: u32) -> Vec<ChildProcess> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&candidate| parent_if_running(candidate) == Some(pid))
        .filter_map(|child| Some(ChildProcess { pid: child, cmdline: cmdline(child)? }))
        .collect()
}

/// The children of `pid` whose command line contains `needle`.
pub fn children_running(pid: u32, needle: &str) -> Vec<ChildProcess> {
    children(pid).into_iter().filter(|child| child.cmdline.contains(needle)).collect()
}

/// Whether `child` still runs the command it ran when found: neither gone, nor a zombie, nor
/// its pid reused by another command.
pub fn still_running(child: &ChildProcess) -> bool {
    is_running(child.pid) && cmdline(child.pid).as_ref() == Some(&child.cmdline)
}

/// The process's arguments joined by spaces; `None` once it is gone (a zombie has none).
fn cmdline(pid: u32) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|arg| !arg.is_empty())
        .map(|arg| String::from_utf8_lossy(arg).into_owned())
        .collect();
    (!args.is_empty()).then(|| args.join(" "))
}

/// The parent's pid, for a process that exists and is not a zombie.
fn parent_if_running(pid: u32) -> Option<u32> {
    let fields = stat_fields(pid)?;
    (fields.first()? != "Z").then_some(())?;
    fields.get(1)?.parse().ok()
}

fn is_running(pid: u32) -> bool {
    stat_fields(pid).is_some_and(|fields| fields.first().is_some_and(|state| state != "Z"))
}

/// The fields of `/proc/PID/stat` after the command name (which may contain spaces and
/// parentheses, so everything up to the last `)` is skipped): state, ppid, ...
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// Samples a value every few milliseconds in the background (a process's resident memory, its
/// number of compiler children, ...) and keeps the highest one seen, until
/// [`PeakWatch::peak`] stops it.
pub struct PeakWatch {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl PeakWatch {
    /// Starts sampling `sample`; a `None` (e.g. the process is gone) is skipped.
    pub fn start(sample: impl Fn() -> Option<u64> + Send + 'static) -> PeakWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(sample().unwrap_or(0)));
        let task = tokio::spawn({
            let (stop, peak) = (stop.clone(), peak.clone());
            async move {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(value) = sample() {
                        peak.fetch_max(value, Ordering::Relaxed);
                    }
                    tokio::time::sleep(SAMPLE_INTERVAL).await;
                }
            }
        });
        PeakWatch { stop, peak, task }
    }

    /// The resident memory of process `pid`.
    pub fn memory(pid: u32) -> PeakWatch {
        PeakWatch::start(move || rss_bytes(pid))
    }

    /// How many children of process `pid` run a command line containing `needle`.
    pub fn children_running(pid: u32, needle: &'static str) -> PeakWatch {
        PeakWatch::start(move || Some(children_running(pid, needle).len() as u64))
    }

    /// Stops sampling and returns the highest value seen.
    pub async fn peak(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.task.await;
        self.peak.load(Ordering::Relaxed)
    }
}

/// Mebibytes, for messages.
pub fn mib(bytes: u64) -> u64 {
    bytes >> 20
}
