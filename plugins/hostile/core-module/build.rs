//! Links this crate as a plain core WebAssembly module: `wasm-component-ld` skips the step
//! that wraps the module into a component, which is the mistake this fixture stands for.
fn main() {
    println!("cargo:rustc-link-arg=--skip-wit-component");
}
