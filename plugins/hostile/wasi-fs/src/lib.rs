//! Test fixture: reads a host file with `std::fs`, so the component imports
//! `wasi:filesystem`. stockd must refuse it at upload.
// The generated lowering glue takes one argument per flattened field.
#![allow(clippy::too_many_arguments)]

wit_bindgen::generate!({ path: "../../../wit", world: "planner" });

struct Snoop;

impl Guest for Snoop {
    fn plan(_order: Order, _ctx: Context) -> Result<Plan, String> {
        Err(std::fs::read_to_string("/etc/passwd").unwrap_or_default())
    }
}

export!(Snoop);
