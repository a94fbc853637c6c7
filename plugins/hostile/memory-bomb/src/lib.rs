//! Test fixture: allocates (and touches) memory until the host's cap stops it. It writes one
//! byte per page, so it reaches the memory cap long before it could run out of fuel.
#![no_std]

use core::mem::MaybeUninit;

use stockd_plugin_sdk::*;

/// Bytes taken per allocation.
const CHUNK_BYTES: usize = 1 << 20;
/// WebAssembly's page size.
const PAGE_BYTES: usize = 64 << 10;

struct Bomb;

impl Guest for Bomb {
    fn plan(_order: Order, _ctx: Context) -> Result<Plan, String> {
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        loop {
            let mut chunk: Vec<u8> = Vec::with_capacity(CHUNK_BYTES);
            for page in chunk.spare_capacity_mut().iter_mut().step_by(PAGE_BYTES) {
                *page = MaybeUninit::new(1);
            }
            hoard.push(core::hint::black_box(chunk));
        }
    }
}

export_planner!(Bomb);
