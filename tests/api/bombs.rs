//! Compile bombs: valid WebAssembly components that are cheap to send and expensive to compile.
//! Each is a working planner (an example plugin) carrying one more core module that nothing
//! instantiates but that a compiler still compiles, so a server without compile limits would
//! accept it once it had finished compiling.
//!
//! The core module's functions are written so that Cranelift's work grows with the product of
//! join points and live locals: every function keeps `locals` 64-bit locals alive from its
//! first instruction to its last and passes them through `joins` conditional branches, each of
//! which ends a block the locals flow through.

use wasm_encoder::{
    BlockType, CodeSection, ComponentSection, Function, FunctionSection, Instruction, Module, ModuleSection,
    TypeSection, ValType,
};

/// The shape of a generated core module.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Functions in the module, all alike.
    pub functions: u32,
    /// 64-bit locals declared by each function (besides its one `i32` parameter).
    pub locals: u32,
    /// Blocks each function runs through one after another, each left early by a `br_if`.
    pub joins: u32,
    /// How deeply the blocks nest: 1 is a flat sequence; `n` wraps each group of `n` blocks
    /// inside one another, so a `br_if` may leave several at once.
    pub depth: u32,
}

/// The component `planner` with one more core module of `shape`, which nothing instantiates:
/// still a working planner, but compiling it costs what compiling the bomb costs.
pub fn planner_with(planner: &[u8], shape: Shape) -> Vec<u8> {
    let mut bytes = planner.to_vec();
    // Component sections may come in any order; a module nothing refers to is still compiled.
    ModuleSection(&module(shape)).append_to_component(&mut bytes);
    bytes
}

/// A core module of `shape`: every function has type `(i32) -> i64`.
pub fn module(shape: Shape) -> Module {
    let mut types = TypeSection::new();
    types.ty().function([ValType::I32], [ValType::I64]);
    let mut functions = FunctionSection::new();
    let mut code = CodeSection::new();
    let body = function(shape);
    for _ in 0..shape.functions {
        functions.function(0);
        code.function(&body);
    }
    let mut module = Module::new();
    module.section(&types).section(&functions).section(&code);
    module
}

/// One function of `shape`. Local 0 is the parameter; locals 1..=`locals` are the `i64`s.
fn function(shape: Shape) -> Function {
    let locals = shape.locals.max(1);
    let depth = shape.depth.max(1);
    let mut f = Function::new([(locals, ValType::I64)]);
    // Every local starts from the parameter, so none is a constant the compiler could fold.
    for local in 1..=locals {
        f.instruction(&Instruction::LocalGet(0))
            .instruction(&Instruction::I64ExtendI32U)
            .instruction(&Instruction::I64Const(i64::from(local)))
            .instruction(&Instruction::I64Add)
            .instruction(&Instruction::LocalSet(local));
    }
    let mut open = 0;
    for join in 0..shape.joins {
        f.instruction(&Instruction::Block(BlockType::Empty));
        open += 1;
        // Leave as many blocks as are open in this group, varying with the join.
        f.instruction(&Instruction::LocalGet(0)).instruction(&Instruction::BrIf(join % open));
        // One local changes on the path that falls through, so the join merges two values.
        let changed = 1 + join % locals;
        f.instruction(&Instruction::LocalGet(changed))
            .instruction(&Instruction::LocalGet(0))
            .instruction(&Instruction::I64ExtendI32U)
            .instruction(&Instruction::I64Add)
            .instruction(&Instruction::LocalSet(changed));
        if open == depth {
            for _ in 0..open {
                f.instruction(&Instruction::End);
            }
            open = 0;
        }
    }
    for _ in 0..open {
        f.instruction(&Instruction::End);
    }
    // Every local is used at the end: all of them are live across every join.
    f.instruction(&Instruction::LocalGet(1));
    for local in 2..=locals {
        f.instruction(&Instruction::LocalGet(local)).instruction(&Instruction::I64Xor);
    }
    f.instruction(&Instruction::End);
    f
}
