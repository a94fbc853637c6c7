//! Test fixture: imports nothing, but its `plan` export has the wrong signature. stockd must
//! refuse it at upload because it does not implement the `planner` world.
#![no_std]

extern crate alloc;

wit_bindgen::generate!({ path: "wit", world: "planner" });

#[global_allocator]
static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    core::arch::wasm32::unreachable()
}

struct Wrong;

impl Guest for Wrong {
    fn plan(line_count: u32) -> u32 {
        line_count
    }
}

export!(Wrong);
