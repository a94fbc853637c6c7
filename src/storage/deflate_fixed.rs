//! A raw deflate encoder for small values against a preset dictionary (RFC 1951): greedy LZ77
//! over the dictionary followed by the value, in one final block of deflate's fixed Huffman
//! codes. Any inflater given the same dictionary decodes it ([`super::payload`] uses zlib-rs).
//!
//! Why not zlib's own deflate: it starts every stream by clearing a 128 KiB hash table (zlib-rs
//! keeps it at 64 Ki entries whatever the window), which cost ~290,000 instructions (~5 us) an
//! answer of 240 bytes, more than the rest of the order. Here the dictionary's index is built
//! once, and a value's own index is sized to the value: ~8,000 instructions a one-line answer,
//! ~32,000 a five-line one. Fixed codes lose little on values this small: within 2-7 bytes of
//! zlib's best level.

use std::sync::OnceLock;

/// Shortest match coded (the index hashes four bytes).
const MIN_MATCH: usize = 4;
/// Longest match deflate codes.
const MAX_MATCH: usize = 258;
/// Farthest back a match may start (a 32 KiB window).
const MAX_DISTANCE: usize = 32_768;
/// Candidates tried per position, in each index.
const MAX_CHAIN: usize = 16;
/// A match this long is taken without looking for a longer one.
const NICE_MATCH: usize = 64;
/// The longest match whose every position is indexed for later matches.
const MAX_INSERT: usize = 8;
/// The dictionary's index: 2^DICT_HASH_BITS chains.
const DICT_HASH_BITS: u32 = 12;

/// Lengths 3..=258: the first length of each code 257..=285, and its extra bits.
const LENGTH_BASE: [u16; 29] =
    [3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258];
const LENGTH_EXTRA: [u8; 29] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0];
/// Distances 1..=32768: the first distance of each code 0..=29, and its extra bits.
const DISTANCE_BASE: [u16; 30] = [
    1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537, 2049, 3073, 4097, 6145,
    8193, 12289, 16385, 24577,
];
const DISTANCE_EXTRA: [u8; 30] =
    [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13];

/// The chains of a byte string's four-byte prefixes: `head[hash]` is the latest position + 1
/// with that hash (0: none), `prev[position]` the one before it.
struct Chains {
    bits: u32,
    head: Vec<u32>,
    prev: Vec<u32>,
}

impl Chains {
    fn new(bits: u32, len: usize) -> Self {
        Self { bits, head: vec![0; 1 << bits], prev: vec![0; len] }
    }

    fn hash(&self, bytes: &[u8], at: usize) -> usize {
        let four = bytes.get(at..at + MIN_MATCH).and_then(|b| b.try_into().ok()).unwrap_or([0; 4]);
        (u32::from_le_bytes(four).wrapping_mul(2_654_435_761) >> (32 - self.bits)) as usize
    }

    fn insert(&mut self, bytes: &[u8], at: usize) {
        if at + MIN_MATCH <= bytes.len() {
            let h = self.hash(bytes, at);
            self.prev[at] = self.head[h];
            self.head[h] = at as u32 + 1;
        }
    }

    /// Positions with the same hash as `at`'s four bytes, latest first, at most [`MAX_CHAIN`].
    fn candidates<'a>(&'a self, bytes: &[u8], at: usize) -> impl Iterator<Item = usize> + 'a {
        let mut next = self.head[self.hash(bytes, at)];
        std::iter::from_fn(move || {
            let position = next.checked_sub(1)? as usize;
            next = self.prev[position];
            Some(position)
        })
        .take(MAX_CHAIN)
    }
}

/// A dictionary with its index, built once.
pub struct Dictionary {
    bytes: &'static [u8],
    chains: OnceLock<Chains>,
}

impl Dictionary {
    pub const fn new(bytes: &'static [u8]) -> Self {
        Self { bytes, chains: OnceLock::new() }
    }

    fn chains(&self) -> &Chains {
        self.chains.get_or_init(|| {
            let mut chains = Chains::new(DICT_HASH_BITS, self.bytes.len());
            for at in 0..self.bytes.len() {
                chains.insert(self.bytes, at);
            }
            chains
        })
    }
}

/// Bits written least significant first, as deflate packs them.
struct Bits {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl Bits {
    fn put(&mut self, value: u32, bits: u32) {
        self.acc |= u64::from(value) << self.n;
        self.n += bits;
        while self.n >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n -= 8;
        }
    }

    /// A Huffman code: sent most significant bit first.
    fn code(&mut self, code: u32, bits: u32) {
        self.put(code.reverse_bits() >> (32 - bits), bits);
    }

    /// A literal/length symbol in the fixed code (RFC 1951, 3.2.6).
    fn symbol(&mut self, symbol: u32) {
        match symbol {
            0..=143 => self.code(0x30 + symbol, 8),
            144..=255 => self.code(0x190 + symbol - 144, 9),
            256..=279 => self.code(symbol - 256, 7),
            _ => self.code(0xc0 + symbol - 280, 8),
        }
    }

    fn matched(&mut self, length: usize, distance: usize) {
        let l = LENGTH_BASE.iter().rposition(|&b| usize::from(b) <= length).unwrap_or(0);
        self.symbol(257 + l as u32);
        self.put((length - usize::from(LENGTH_BASE[l])) as u32, u32::from(LENGTH_EXTRA[l]));
        let d = DISTANCE_BASE.iter().rposition(|&b| usize::from(b) <= distance).unwrap_or(0);
        self.code(d as u32, 5);
        self.put((distance - usize::from(DISTANCE_BASE[d])) as u32, u32::from(DISTANCE_EXTRA[d]));
    }

    fn finish(mut self) -> Vec<u8> {
        if self.n > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

/// `input` as one final fixed-code deflate block, its matches reaching into `dictionary`.
pub fn deflate(dictionary: &Dictionary, input: &[u8]) -> Vec<u8> {
    let dict = dictionary.bytes;
    let dict_chains = dictionary.chains();
    let bits = (input.len().max(32) * 2).next_power_of_two().trailing_zeros().min(16);
    let mut own = Chains::new(bits, input.len());
    let mut out = Bits { out: Vec::with_capacity(input.len() / 2 + 16), acc: 0, n: 0 };
    out.put(1, 1); // the final block
    out.put(1, 2); // of fixed codes
    let mut at = 0;
    while at < input.len() {
        let (mut best, mut distance) = (0, 0);
        if at + MIN_MATCH <= input.len() {
            let longest = (input.len() - at).min(MAX_MATCH);
            let wanted = &input[at..at + longest];
            // Earlier in the value: may overlap the bytes being coded, as LZ77 allows.
            for from in own.candidates(input, at) {
                if at - from > MAX_DISTANCE || best >= NICE_MATCH.min(longest) {
                    break;
                }
                let n = common(&input[from..], wanted);
                if n > best {
                    (best, distance) = (n, at - from);
                }
            }
            // In the dictionary, running on into the value if it matches that far.
            for from in dict_chains.candidates(input, at) {
                let reach = dict.len() - from + at;
                if reach > MAX_DISTANCE || best >= NICE_MATCH.min(longest) {
                    break;
                }
                let mut n = common(&dict[from..], wanted);
                if from + n == dict.len() {
                    n += common(input, &wanted[n..]);
                }
                if n > best {
                    (best, distance) = (n, reach);
                }
            }
        }
        if best >= MIN_MATCH {
            out.matched(best, distance);
            // Every position of a short match indexed, of a long one (most come whole from the
            // dictionary) only the first: zlib's trade at its faster levels.
            let indexed = if best <= MAX_INSERT { best } else { 1 };
            for i in at..at + indexed {
                own.insert(input, i);
            }
            at += best;
        } else {
            out.symbol(u32::from(input[at]));
            own.insert(input, at);
            at += 1;
        }
    }
    out.symbol(256);
    out.finish()
}

/// How many bytes at the start of `history` and `wanted` are equal: eight at a time, the first
/// difference found from the lowest set bit of their exclusive or.
fn common(history: &[u8], wanted: &[u8]) -> usize {
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
    let mut n = 0;
    for (a, b) in history.chunks_exact(8).zip(wanted.chunks_exact(8)) {
        let differ = word(a) ^ word(b);
        if differ != 0 {
            return n + (differ.trailing_zeros() / 8) as usize;
        }
        n += 8;
    }
    n + history[n..].iter().zip(&wanted[n..]).take_while(|(a, b)| a == b).count()
}
