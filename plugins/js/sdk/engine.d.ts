// Globals of the JavaScript engine inside a component (StarlingMonkey, as componentize-js
// builds it with every WASI feature disabled) that the SDK uses beyond ES2022. The engine has
// no DOM, no Node.js APIs, no console output, no `\p{...}` in regular expressions, and no
// clock or randomness to rely on: plans get the time from `ctx.nowMs` and a seed from
// `ctx.seed`.

declare class TextEncoder {
  encode(input?: string): Uint8Array;
}
