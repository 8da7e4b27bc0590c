//! Helpers shared by the GGUF tests: a raw GGUF encoder that can write files our writer
//! never would (bad offsets, duplicate names, lying lengths), and a scratch directory.

#![allow(dead_code)]

use bmoe_engine::gguf::{GgmlType, GgufError, TensorSpec, Value, ValueType};
use std::path::PathBuf;

/// A model to write: metadata, then tensors with their bytes.
pub type Model = (Vec<(String, Value)>, Vec<(TensorSpec, Vec<u8>)>);

/// A tensor info as it will be encoded, offsets relative to the data section.
#[derive(Clone, Debug)]
pub struct RawTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub offset: u64,
}

/// A GGUF file described field by field, encoded verbatim.
#[derive(Clone, Debug)]
pub struct Raw {
    pub magic: u32,
    pub version: u32,
    /// (key, value type id, encoded value)
    pub kvs: Vec<(String, u32, Vec<u8>)>,
    pub tensors: Vec<RawTensor>,
    /// Alignment used to pad the end of the tensor table (not written as a key).
    pub alignment: u64,
    pub data: Vec<u8>,
}

/// Byte positions of the u64 fields of an encoded file (for targeted mutations).
#[derive(Clone, Debug, Default)]
pub struct Layout {
    pub u64_fields: Vec<usize>,
    pub data_start: usize,
}

pub fn kv(key: &str, v: &Value) -> (String, u32, Vec<u8>) {
    let mut b = Vec::new();
    v.encode_into(&mut b);
    (key.to_string(), v.value_type() as u32, b)
}

fn str_positions(start: usize, v: &Value, out: &mut Vec<usize>) -> usize {
    // Walk an encoded value to find its u64 length fields; returns its encoded length.
    match v {
        Value::String(s) => {
            out.push(start);
            8 + s.len()
        }
        Value::Array(_, items) => {
            out.push(start + 4);
            let mut n = 12;
            for it in items {
                n += str_positions(start + n, it, out);
            }
            n
        }
        Value::U64(_) | Value::I64(_) => {
            out.push(start);
            8
        }
        other => {
            let mut b = Vec::new();
            other.encode_into(&mut b);
            b.len()
        }
    }
}

impl Raw {
    /// Encode; `values` (when given) are the decoded KV values, used to record the
    /// positions of their length fields in the layout.
    pub fn encode(&self, values: Option<&[Value]>) -> (Vec<u8>, Layout) {
        let mut b = Vec::new();
        let mut lay = Layout::default();
        b.extend_from_slice(&self.magic.to_le_bytes());
        b.extend_from_slice(&self.version.to_le_bytes());
        lay.u64_fields.push(b.len());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        lay.u64_fields.push(b.len());
        b.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (i, (k, t, v)) in self.kvs.iter().enumerate() {
            lay.u64_fields.push(b.len());
            Value::String(k.clone()).encode_into(&mut b);
            b.extend_from_slice(&t.to_le_bytes());
            let start = b.len();
            b.extend_from_slice(v);
            if let Some(vals) = values {
                str_positions(start, &vals[i], &mut lay.u64_fields);
            }
        }
        for t in &self.tensors {
            lay.u64_fields.push(b.len());
            Value::String(t.name.clone()).encode_into(&mut b);
            b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                lay.u64_fields.push(b.len());
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&t.ty.to_le_bytes());
            lay.u64_fields.push(b.len());
            b.extend_from_slice(&t.offset.to_le_bytes());
        }
        let a = self.alignment as usize;
        b.resize(b.len().div_ceil(a) * a, 0);
        lay.data_start = b.len();
        b.extend_from_slice(&self.data);
        (b, lay)
    }

    pub fn bytes(&self) -> Vec<u8> {
        self.encode(None).0
    }

    /// Parse with our reader, expecting an error.
    pub fn err(&self) -> GgufError {
        match bmoe_engine::gguf::GgufFile::from_bytes("bad.gguf", self.bytes()) {
            Ok(_) => panic!("expected an error for {self:?}"),
            Err(e) => e,
        }
    }
}

/// Metadata of the small valid file: one value of every type, nested arrays included.
pub fn sample_metadata() -> Vec<(String, Value)> {
    vec![
        (
            "general.architecture".into(),
            Value::String("qwen3moe".into()),
        ),
        ("general.alignment".into(), Value::U32(32)),
        ("t.u8".into(), Value::U8(200)),
        ("t.i8".into(), Value::I8(-5)),
        ("t.u16".into(), Value::U16(65_000)),
        ("t.i16".into(), Value::I16(-30_000)),
        ("t.u32".into(), Value::U32(4_000_000_000)),
        ("t.i32".into(), Value::I32(-2_000_000_000)),
        ("t.f32".into(), Value::F32(1.25)),
        ("t.bool".into(), Value::Bool(true)),
        ("t.str".into(), Value::String("héllo".into())),
        ("t.u64".into(), Value::U64(u64::MAX - 1)),
        ("t.i64".into(), Value::I64(i64::MIN + 1)),
        ("t.f64".into(), Value::F64(-2.5e300)),
        ("t.strs".into(), Value::strings(["a b", "c", ""])),
        (
            "t.nested".into(),
            Value::Array(
                ValueType::Array,
                vec![
                    Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-2)]),
                    Value::Array(ValueType::I32, vec![]),
                ],
            ),
        ),
    ]
}

/// A valid file: the sample metadata and three tensors (F32, Q8_0, Q4_K) packed at
/// alignment 32, data bytes counting up.
pub fn valid() -> Raw {
    valid_with_values().0
}

pub fn valid_with_values() -> (Raw, Vec<Value>) {
    let md = sample_metadata();
    let tensors = vec![
        RawTensor {
            name: "a".into(),
            dims: vec![8, 2],
            ty: GgmlType::F32.id(),
            offset: 0,
        },
        RawTensor {
            name: "b".into(),
            dims: vec![32, 2],
            ty: GgmlType::Q8_0.id(),
            offset: 64,
        },
        RawTensor {
            name: "c".into(),
            dims: vec![256, 1, 2],
            ty: GgmlType::Q4_K.id(),
            offset: 160,
        },
    ];
    // a: 64 bytes; b: 68 -> padded to 96 (ends 160); c: 288 bytes (ends 448).
    let data = (0..448u32).map(|i| (i * 7) as u8).collect();
    let raw = Raw {
        magic: 0x4655_4747,
        version: 3,
        kvs: md.iter().map(|(k, v)| kv(k, v)).collect(),
        tensors,
        alignment: 32,
        data,
    };
    (raw, md.into_iter().map(|(_, v)| v).collect())
}

/// A fresh scratch directory under cargo's target tmp dir.
pub fn scratch(name: &str) -> PathBuf {
    let d = bmoe_engine::testdata::scratch_dir(&format!("gguf-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// Whether the env says we are in CI (then skipping is failing).
pub fn in_ci() -> bool {
    std::env::var("CI")
        .map(|v| v == "true" || v == "1")
        .unwrap_or(false)
}
