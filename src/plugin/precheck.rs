//! Structural checks on an uploaded component before anything compiles it: how many functions
//! it has, how large each body is, how many locals each declares and how deeply its blocks nest.
//! Compile time and memory grow with these (a function with tens of thousands of locals inside
//! deeply nested blocks costs Cranelift gigabytes), so refusing the outliers here, in one
//! linear pass that allocates almost nothing, answers an obvious bomb at once. What passes still
//! compiles only in a child process under hard limits (`compile.rs`): these checks are the
//! cheap first line, not the guarantee.

use wasmparser::{Operator, Parser, Payload};

use super::model::PluginInvalid;

/// The shape limits a component must stay within (`[plugins]` settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShapeLimits {
    /// Function bodies across every core module of the component.
    pub max_functions: usize,
    /// Bytes of one function body.
    pub max_function_body_bytes: usize,
    /// Locals one function declares (parameters not counted).
    pub max_locals_per_function: u64,
    /// Nesting depth of `block`, `loop`, `if` and `try_table` within one function.
    pub max_block_depth: usize,
}

impl Default for ShapeLimits {
    fn default() -> Self {
        // The example plugins (release builds, 16-35 KiB) peak at 52 functions, 7 KiB bodies,
        // 28 locals and depth 46 (`stockd plugin check` prints a component's figures); these
        // leave one to three orders of magnitude of room for real code.
        Self {
            max_functions: 20_000,
            max_function_body_bytes: 256 << 10,
            max_locals_per_function: 5_000,
            max_block_depth: 500,
        }
    }
}

/// What a component's code looks like, as [`check_shape`] measured it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shape {
    pub functions: usize,
    pub largest_body_bytes: usize,
    pub most_locals: u64,
    pub deepest_blocks: usize,
}

/// Measures every function body of every core module in `wasm` and refuses the component at
/// the first limit it exceeds. Malformed bytes are refused too (the compiler would refuse them
/// anyway, and nothing malformed should reach it).
pub fn check_shape(wasm: &[u8], limits: &ShapeLimits) -> Result<Shape, PluginInvalid> {
    let malformed =
        |e: wasmparser::BinaryReaderError| PluginInvalid::new(format!("the component does not compile: {e}"));
    let mut shape = Shape::default();
    for payload in Parser::new(0).parse_all(wasm) {
        let Payload::CodeSectionEntry(body) = payload.map_err(malformed)? else { continue };
        shape.functions += 1;
        let function = shape.functions;
        if shape.functions > limits.max_functions {
            return Err(PluginInvalid::new(format!(
                "the component has more than {} functions (the limit)",
                limits.max_functions
            )));
        }
        let mut locals: u64 = 0;
        for declared in body.get_locals_reader().map_err(malformed)? {
            let (count, _) = declared.map_err(malformed)?;
            locals += u64::from(count);
            if locals > limits.max_locals_per_function {
                return Err(PluginInvalid::new(format!(
                    "function {function} declares more than {} locals (the limit per function)",
                    limits.max_locals_per_function
                )));
            }
        }
        shape.most_locals = shape.most_locals.max(locals);
        let body_bytes = body.range().len();
        shape.largest_body_bytes = shape.largest_body_bytes.max(body_bytes);
        if body_bytes > limits.max_function_body_bytes {
            return Err(PluginInvalid::new(format!(
                "function {function} has a body of {body_bytes} bytes; the limit is {} bytes per function body",
                limits.max_function_body_bytes
            )));
        }
        let mut depth = 0usize;
        let mut operators = body.get_operators_reader().map_err(malformed)?;
        while !operators.eof() {
            match operators.read().map_err(malformed)? {
                Operator::Block { .. } | Operator::Loop { .. } | Operator::If { .. } | Operator::TryTable { .. } => {
                    depth += 1;
                    shape.deepest_blocks = shape.deepest_blocks.max(depth);
                    if depth > limits.max_block_depth {
                        return Err(PluginInvalid::new(format!(
                            "function {function} nests blocks deeper than the block depth limit of {}",
                            limits.max_block_depth
                        )));
                    }
                }
                Operator::End => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
    }
    Ok(shape)
}
