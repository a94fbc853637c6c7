//! Everything a stockd planning plugin needs besides its own rules.
//!
//! A plugin is a WebAssembly component exporting the `stockd:plugin/planner` world (see
//! `wit/stockd-plugin.wit` at the repository root). stockd refuses components that import
//! anything, and Rust's `std` on `wasm32-wasip2` imports WASI (stdio, environment, exit) as
//! soon as anything can panic, so plugins are `#![no_std]` with `alloc`. This crate supplies
//! what `std` would have: a global allocator and a panic handler (a panic becomes a trap,
//! which stockd reports as `plugin_failed`), plus the generated bindings and a few helpers
//! that several plugins share (configuration lines, attributes, a stable hash, UTC months).
//!
//! A plugin crate is a `cdylib` that depends on this crate and writes:
//!
//! ```ignore
//! #![no_std]
//! use stockd_plugin_sdk::*;
//! struct MyPlugin;
//! impl Guest for MyPlugin {
//!     fn plan(order: Order, ctx: Context) -> Result<Plan, String> { /* ... */ }
//! }
//! export_planner!(MyPlugin);
//! ```
#![no_std]

extern crate alloc;
// The generated bindings name this crate by its public path, so that path must work inside too.
extern crate self as stockd_plugin_sdk;

pub use alloc::borrow::ToOwned;
pub use alloc::format;
pub use alloc::string::{String, ToString};
pub use alloc::vec;
pub use alloc::vec::Vec;

#[doc(hidden)]
pub use wit_bindgen as __wit_bindgen;

/// The bindings generated from `wit/stockd-plugin.wit`, re-exported at the crate root.
// The generated lowering glue takes one argument per flattened field.
#[allow(clippy::too_many_arguments)]
mod bindings {
    // A module of its own: `#[macro_export]` puts the export macros at the crate root, and
    // the generator's own `pub use` of them must live elsewhere to not clash.
    wit_bindgen::generate!({
        path: "../../wit",
        world: "planner",
        pub_export_macro: true,
        export_macro_name: "export_planner",
        default_bindings_module: "stockd_plugin_sdk",
        runtime_path: "stockd_plugin_sdk::__wit_bindgen::rt",
    });
}

pub use bindings::*;

#[global_allocator]
static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

// `core` calls `memcmp`/`bcmp` (string comparison), which on wasm32-wasip2 come from the
// target's wasi-libc. `std` links it; a `no_std` plugin asks for it here. Only those pure
// functions are taken from it, so the component still imports nothing.
#[link(name = "c")]
unsafe extern "C" {}

/// The component model's allocation hook: the host calls it to place the order's strings and
/// lists in the plugin's memory. On `wasm32-wasip2` it normally comes from `std`; a `no_std`
/// plugin must export its own.
///
/// # Safety
/// Called only by the canonical ABI, with `old_ptr`/`old_len`/`align` describing a block this
/// function returned before (or `old_len == 0`), and `align` a power of two.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cabi_realloc(old_ptr: *mut u8, old_len: usize, align: usize, new_len: usize) -> *mut u8 {
    use alloc::alloc::{Layout, alloc, realloc};
    if new_len == 0 {
        // A zero-sized block needs no memory, only a well-aligned non-null address.
        return align as *mut u8;
    }
    // SAFETY: the canonical ABI guarantees a power-of-two `align` and, for `old_len > 0`, a
    // block previously allocated here with that layout.
    let ptr = unsafe {
        if old_len == 0 {
            alloc(Layout::from_size_align_unchecked(new_len, align))
        } else {
            realloc(old_ptr, Layout::from_size_align_unchecked(old_len, align), new_len)
        }
    };
    if ptr.is_null() {
        // Out of memory (stockd caps plugin memory): trap rather than hand back null.
        core::arch::wasm32::unreachable()
    }
    ptr
}

/// A panic traps the instance: stockd discards it and answers `plugin_failed`. There is
/// nowhere to print the message (the plugin has no I/O), so it is dropped.
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    core::arch::wasm32::unreachable()
}

/// Longest resource or limit key stockd accepts.
pub const MAX_KEY_LEN: usize = 200;

/// Whether `key` is a key stockd accepts: 1-200 characters of `[A-Za-z0-9._:@-]`. A plan with
/// any other key is refused by the host, so plugins check keys they build from client input
/// and refuse the order with a readable reason instead.
pub fn is_valid_key(key: &str) -> bool {
    (1..=MAX_KEY_LEN).contains(&key.len()) && key.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:@-".contains(&b))
}

/// Returns `key` if it is a valid key, or an error naming what it was built for.
pub fn checked_key(key: String, what: &str) -> Result<String, String> {
    if is_valid_key(&key) {
        Ok(key)
    } else {
        Err(format!("{what} {key:?} is not 1-{MAX_KEY_LEN} characters of [A-Za-z0-9._:@-]"))
    }
}

/// The value of `name` in the tenant's plugin configuration: lines (or `;`-separated items)
/// of `name = value`; `#` starts a comment. The last occurrence wins.
pub fn config_value<'a>(config: &'a str, name: &str) -> Option<&'a str> {
    config
        .split(['\n', ';'])
        .map(|item| item.split('#').next().unwrap_or(""))
        .filter_map(|item| item.split_once('='))
        .filter(|(key, _)| key.trim() == name)
        .map(|(_, value)| value.trim())
        .next_back()
}

/// A numeric configuration value: `default` when absent, an error when present but not a
/// number in `min..=max`.
pub fn config_number(config: &str, name: &str, default: i64, min: i64, max: i64) -> Result<i64, String> {
    match config_value(config, name) {
        None => Ok(default),
        Some(text) => match text.parse::<i64>() {
            Ok(n) if (min..=max).contains(&n) => Ok(n),
            _ => Err(format!("config {name}={text:?} must be a number between {min} and {max}")),
        },
    }
}

/// The value of the attribute `name` on an order line, if the client sent it.
pub fn attribute<'a>(line: &'a OrderLine, name: &str) -> Option<&'a str> {
    line.attributes.iter().find(|(key, _)| key == name).map(|(_, value)| value.as_str())
}

/// The user id, or an error saying why this plugin needs one.
pub fn require_user<'a>(order: &'a Order, why: &str) -> Result<&'a str, String> {
    order.user_id.as_deref().ok_or_else(|| format!("order {:?} has no user_id; {why}", order.order_id))
}

/// A stable 64-bit hash (FNV-1a): the same text gives the same number in every build and on
/// every machine, unlike `core::hash`'s hashers, so bucket orders are reproducible.
pub fn stable_hash(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3))
}

/// The UTC calendar month of a Unix time in milliseconds, as `(year, month)` with month
/// 1..=12. Plugins have no clock: they get `now` from [`Context::now_ms`].
pub fn utc_year_month(unix_ms: i64) -> (i64, u32) {
    // Howard Hinnant's days-to-civil algorithm, valid for every i64 day count used here.
    let days = unix_ms.div_euclid(86_400_000) + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let month = if shifted_month < 10 { shifted_month + 3 } else { shifted_month - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month as u32)
}

/// A target with only a resource key: no kind check, no creation, default bucket order.
pub fn target(resource: String) -> Target {
    Target { resource, kind: None, create_if_missing: None, buckets: Vec::new() }
}

/// A planned line for order line `index` with the given targets: the line's own quantity, not
/// mandatory, no per-user limit.
pub fn planned(index: usize, line: &OrderLine, targets: Vec<Target>) -> PlannedLine {
    PlannedLine { line: index as u32, qty: line.qty, mandatory: false, targets, limit: None }
}

/// The plan of stockd's built-in default: each line takes its own quantity from the resource
/// named by its key, all-or-nothing, no kind check, no per-user limit, no creation.
pub fn default_plan(order: &Order) -> Plan {
    let lines = order
        .lines
        .iter()
        .enumerate()
        .map(|(index, line)| planned(index, line, vec![target(line.key.clone())]))
        .collect();
    Plan { policy: Policy::AllOrNothing, lines }
}
