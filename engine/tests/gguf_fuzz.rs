//! Mutated GGUF files parse to `Ok` or a typed error: never a panic, never an allocation
//! out of proportion to the file. Its own test binary, because it installs a global
//! allocator that records the largest single allocation made while parsing.

#[path = "gguf/common.rs"]
mod common;

use bmoe_engine::gguf::GgufFile;
use common::*;
use proptest::collection::vec;
use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, recording the largest request.
struct Recording;
static LARGEST_BYTES: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Recording {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST_BYTES.fetch_max(layout.size(), Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST_BYTES.fetch_max(new_size, Ordering::Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOC: Recording = Recording;

#[derive(Clone, Debug)]
enum Mutation {
    /// XOR one byte.
    Flip(usize, u8),
    /// Cut the file at this position.
    Truncate(usize),
    /// Insert garbage at this position.
    Insert(usize, Vec<u8>),
    /// Overwrite the n-th known u64 field (counts, string and array lengths, dims,
    /// offsets) with an extreme value.
    Extreme(usize, u64),
    /// Overwrite 8 bytes anywhere with an extreme value.
    ExtremeAnywhere(usize, u64),
}

fn extreme() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(u64::MAX),
        Just(u64::MAX - 7),
        Just(i64::MAX as u64),
        Just(1u64 << 63),
        Just(1u64 << 32),
        Just(u32::MAX as u64),
        Just(0),
        Just(1),
        1u64..4096,
        any::<u64>(),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(i, x)| Mutation::Flip(i, x)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), vec(any::<u8>(), 1..24)).prop_map(|(i, g)| Mutation::Insert(i, g)),
        (any::<usize>(), extreme()).prop_map(|(i, v)| Mutation::Extreme(i, v)),
        (any::<usize>(), extreme()).prop_map(|(i, v)| Mutation::ExtremeAnywhere(i, v)),
    ]
}

fn apply(mut b: Vec<u8>, fields: &[usize], muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        if b.is_empty() {
            break;
        }
        let n = b.len();
        match m {
            Mutation::Flip(i, x) => b[i % n] ^= x,
            Mutation::Truncate(i) => b.truncate(i % n),
            Mutation::Insert(i, g) => {
                let at = i % (n + 1);
                b.splice(at..at, g.iter().copied());
            }
            Mutation::Extreme(i, v) | Mutation::ExtremeAnywhere(i, v) => {
                let at = match m {
                    Mutation::Extreme(..) => fields[i % fields.len()],
                    _ => i % n,
                };
                if at + 8 <= n {
                    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    b
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn mutated_files_give_ok_or_a_typed_error(muts in vec(mutation(), 1..4)) {
        let (raw, values) = valid_with_values();
        let (bytes, layout) = raw.encode(Some(&values));
        let mutated = apply(bytes, &layout.u64_fields, &muts);
        let len = mutated.len();
        // The file's own buffer is counted too: allow a fixed multiple of its size.
        let limit_bytes = 64 * len + (64 << 10);
        LARGEST_BYTES.store(0, Ordering::Relaxed);
        let result = GgufFile::from_bytes("fuzz.gguf", mutated);
        let largest = LARGEST_BYTES.load(Ordering::Relaxed);
        prop_assert!(largest <= limit_bytes, "a {len}-byte file made a {largest}-byte allocation");
        match result {
            Ok(f) => {
                for t in f.tensors() {
                    prop_assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
                    if let Some(n) = t.n_slices() {
                        if n > 0 {
                            let last = t.slice_extent(n - 1).expect("last slice");
                            prop_assert!(last.offset + last.len <= t.offset + t.n_bytes);
                        }
                    }
                }
            }
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(msg.starts_with("fuzz.gguf: "), "{}", msg);
            }
        }
    }
}

/// The layout helper finds the fields it claims to (else the targeted mutations would
/// silently hit random bytes).
#[test]
fn layout_points_at_u64_fields() {
    let (raw, values) = valid_with_values();
    let (bytes, layout) = raw.encode(Some(&values));
    let at = |p: usize| u64::from_le_bytes(bytes[p..p + 8].try_into().expect("8 bytes"));
    assert_eq!(at(layout.u64_fields[0]), 3, "tensor_count");
    assert_eq!(
        at(layout.u64_fields[1]),
        values.len() as u64,
        "metadata_kv_count"
    );
    assert_eq!(
        at(layout.u64_fields[2]),
        "general.architecture".len() as u64
    );
    assert_eq!(at(layout.u64_fields[3]), "qwen3moe".len() as u64);
    assert_eq!(
        at(*layout.u64_fields.last().expect("fields")),
        160,
        "offset of c"
    );
    assert!(layout.u64_fields.len() > 30);
}
