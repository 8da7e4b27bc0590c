//! Write → read returns identical metadata and tensor bytes, for every value type (nested
//! arrays included) and every ggml type, over random shapes.

use super::common::*;
use bmoe_engine::gguf::{GgmlType, GgufFile, GgufWriter, TensorSpec, Value, ValueType};
use proptest::collection::vec;
use proptest::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};

const SCALAR_TYPES: [ValueType; 12] = [
    ValueType::U8,
    ValueType::I8,
    ValueType::U16,
    ValueType::I16,
    ValueType::U32,
    ValueType::I32,
    ValueType::F32,
    ValueType::Bool,
    ValueType::String,
    ValueType::U64,
    ValueType::I64,
    ValueType::F64,
];

fn scalar(t: ValueType) -> BoxedStrategy<Value> {
    match t {
        ValueType::U8 => any::<u8>().prop_map(Value::U8).boxed(),
        ValueType::I8 => any::<i8>().prop_map(Value::I8).boxed(),
        ValueType::U16 => any::<u16>().prop_map(Value::U16).boxed(),
        ValueType::I16 => any::<i16>().prop_map(Value::I16).boxed(),
        ValueType::U32 => any::<u32>().prop_map(Value::U32).boxed(),
        ValueType::I32 => any::<i32>().prop_map(Value::I32).boxed(),
        // Any bit pattern, NaNs included: the round trip is bit-exact.
        ValueType::F32 => any::<u32>()
            .prop_map(|b| Value::F32(f32::from_bits(b)))
            .boxed(),
        ValueType::Bool => any::<bool>().prop_map(Value::Bool).boxed(),
        ValueType::String => ".{0,12}".prop_map(Value::String).boxed(),
        ValueType::U64 => any::<u64>().prop_map(Value::U64).boxed(),
        ValueType::I64 => any::<i64>().prop_map(Value::I64).boxed(),
        ValueType::F64 => any::<u64>()
            .prop_map(|b| Value::F64(f64::from_bits(b)))
            .boxed(),
        ValueType::Array => unreachable!("arrays are built by array()"),
    }
}

fn scalar_type() -> impl Strategy<Value = ValueType> {
    proptest::sample::select(SCALAR_TYPES.to_vec())
}

/// An array of scalars, or (while `depth` allows) an array of arrays.
fn array(depth: u32) -> BoxedStrategy<Value> {
    let flat = (scalar_type(), 0..6usize)
        .prop_flat_map(|(t, n)| vec(scalar(t), n).prop_map(move |v| Value::Array(t, v)))
        .boxed();
    if depth == 0 {
        return flat;
    }
    prop_oneof![
        3 => flat,
        1 => vec(array(depth - 1), 0..3).prop_map(|v| Value::Array(ValueType::Array, v)),
    ]
    .boxed()
}

fn value() -> BoxedStrategy<Value> {
    prop_oneof![scalar_type().prop_flat_map(scalar), array(2)].boxed()
}

fn ggml_type() -> impl Strategy<Value = GgmlType> {
    proptest::sample::select(GgmlType::all().collect::<Vec<_>>())
}

/// A tensor spec with 1..=4 dims, whole blocks per row, and a seed for its bytes.
fn tensor(i: usize) -> impl Strategy<Value = (TensorSpec, u64)> {
    (ggml_type(), vec(1u64..4, 1..=4), any::<u64>()).prop_map(move |(ty, mut dims, seed)| {
        dims[0] *= ty.block_size();
        (TensorSpec::new(format!("blk.{i}.w"), &dims, ty), seed)
    })
}

fn bytes_for(spec: &TensorSpec, seed: u64) -> Vec<u8> {
    let n = spec.n_bytes().expect("valid spec") as usize;
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

static CASE: AtomicU64 = AtomicU64::new(0);

fn check_round_trip(
    meta: &[(String, Value)],
    tensors: &[(TensorSpec, Vec<u8>)],
    dir: &std::path::Path,
) -> Result<(), TestCaseError> {
    let path = dir.join(format!(
        "case-{}.gguf",
        CASE.fetch_add(1, Ordering::Relaxed)
    ));
    let size = GgufWriter::write_file(&path, meta, tensors)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(std::fs::metadata(&path).map(|m| m.len()).ok(), Some(size));
    let f = GgufFile::open(&path).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(f.version(), 3);
    prop_assert_eq!(f.metadata().len(), meta.len());
    for ((k1, v1), (k2, v2)) in f.metadata().iter().zip(meta) {
        prop_assert_eq!(k1, k2);
        prop_assert!(v1.bits_eq(v2), "{} read {:?}, wrote {:?}", k1, v1, v2);
    }
    prop_assert_eq!(f.tensors().len(), tensors.len());
    for (t, (spec, data)) in f.tensors().iter().zip(tensors) {
        prop_assert_eq!(&t.name, &spec.name);
        prop_assert_eq!(&t.dims, &spec.dims);
        prop_assert_eq!(t.ty, spec.ty);
        prop_assert_eq!(t.shard, 0);
        prop_assert_eq!(t.offset % f.alignment(), 0);
        prop_assert_eq!(f.tensor_data(t), &data[..]);
    }
    // The in-memory parser agrees with the mapped one.
    let bytes = std::fs::read(&path).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let g = GgufFile::from_bytes(&path, bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(g.tensors(), f.tensors());
    std::fs::remove_file(&path).ok();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn write_then_read_is_identical(
        values in vec(value(), 0..10),
        alignment in proptest::option::of(proptest::sample::select(vec![1u32, 8, 32, 64, 4096])),
        specs in (0..6usize).prop_flat_map(|n| (0..n).map(tensor).collect::<Vec<_>>()),
    ) {
        let dir = scratch_once();
        let mut meta: Vec<(String, Value)> = values
            .into_iter()
            .enumerate()
            .map(|(i, v)| (format!("k{i}.{:?}", v.value_type()), v))
            .collect();
        if let Some(a) = alignment {
            meta.insert(0, ("general.alignment".into(), Value::U32(a)));
        }
        let tensors: Vec<(TensorSpec, Vec<u8>)> =
            specs.into_iter().map(|(s, seed)| { let d = bytes_for(&s, seed); (s, d) }).collect();
        check_round_trip(&meta, &tensors, &dir)?;
    }
}

fn scratch_once() -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| scratch("roundtrip")).clone()
}

/// One tensor of every ggml type, with the sample metadata (every value type).
#[test]
fn every_type_round_trips() {
    let meta = sample_metadata();
    let tensors: Vec<(TensorSpec, Vec<u8>)> = GgmlType::all()
        .enumerate()
        .map(|(i, ty)| {
            let s = TensorSpec::new(format!("t.{ty}"), &[ty.block_size() * 2, 3], ty);
            let d = bytes_for(&s, i as u64 + 1);
            (s, d)
        })
        .collect();
    let dir = scratch("every-type");
    check_round_trip(&meta, &tensors, &dir).expect("round trip");
    std::fs::remove_dir_all(&dir).ok();
}
