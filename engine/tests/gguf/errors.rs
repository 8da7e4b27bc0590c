//! One test per class of bad file: each asserts the error variant, that the message names
//! the file and the field, and what was expected.

use super::common::*;
use bmoe_engine::gguf::{GgmlType, GgufError, GgufFile, GgufWriter, TensorSpec, Value, ValueType};

/// The message names the file and `field`, and the error's field is `field`.
fn names(e: &GgufError, field: &str) -> String {
    let msg = e.to_string();
    assert!(msg.contains("bad.gguf"), "no file name in: {msg}");
    assert_eq!(e.field(), Some(field), "wrong field in: {msg}");
    assert!(msg.contains(field), "field {field:?} not in: {msg}");
    msg
}

#[test]
fn the_valid_sample_parses() {
    let (raw, values) = valid_with_values();
    let f = GgufFile::from_bytes("ok.gguf", raw.bytes()).expect("valid file");
    assert_eq!(f.metadata().len(), values.len());
    assert_eq!(f.tensors().len(), 3);
    assert_eq!(f.tensor("c").map(|t| t.n_bytes), Some(288));
    let data = raw.data.clone();
    assert_eq!(f.tensor_data(f.tensor("c").unwrap()), &data[160..448]);
}

#[test]
fn version_2_reads_like_version_3() {
    let mut raw = valid();
    raw.version = 2;
    let f = GgufFile::from_bytes("v2.gguf", raw.bytes()).expect("v2 file");
    assert_eq!(f.version(), 2);
    assert_eq!(f.tensors().len(), 3);
}

#[test]
fn bad_magic() {
    let mut raw = valid();
    raw.magic = 0x4C4C_4747; // "GGLL"
    let e = raw.err();
    assert!(
        matches!(
            e,
            GgufError::BadMagic {
                found: 0x4C4C_4747,
                ..
            }
        ),
        "{e}"
    );
    let msg = names(&e, "magic");
    assert!(msg.contains("expected 0x46554747"), "{msg}");
}

#[test]
fn unknown_version() {
    for v in [0, 1, 4, 0x0300_0000] {
        let mut raw = valid();
        raw.version = v;
        let e = raw.err();
        assert!(
            matches!(e, GgufError::BadVersion { found, .. } if found == v),
            "{e}"
        );
        let msg = names(&e, "version");
        assert!(msg.contains("versions 2 and 3"), "{msg}");
    }
}

#[test]
fn truncated_header() {
    let b = valid().bytes();
    let e = GgufFile::from_bytes("bad.gguf", b[..20].to_vec()).unwrap_err();
    assert!(
        matches!(
            e,
            GgufError::Truncated {
                needed: 8,
                offset: 16,
                file_len: 20,
                ..
            }
        ),
        "{e}"
    );
    names(&e, "metadata_kv_count");
}

#[test]
fn truncated_metadata() {
    // Cut inside the 8 bytes of "t.f64"'s value.
    let b = valid().bytes();
    let key = b.windows(5).position(|w| w == b"t.f64").expect("key t.f64");
    let cut = key + 5 + 4 + 3;
    let e = GgufFile::from_bytes("bad.gguf", b[..cut].to_vec()).unwrap_err();
    assert!(
        matches!(e, GgufError::Truncated { needed: 8, offset, file_len, .. } if offset == (key + 9) as u64 && file_len == cut as u64),
        "{e}"
    );
    let msg = names(&e, "metadata 't.f64'");
    assert!(msg.contains("needs 8 bytes"), "{msg}");
    // A file of one key, cut inside its u64 value.
    let raw = Raw {
        kvs: vec![kv("k", &Value::U64(1))],
        tensors: vec![],
        data: vec![],
        alignment: 1,
        ..valid()
    };
    let full = raw.bytes();
    let e = GgufFile::from_bytes("bad.gguf", full[..full.len() - 4].to_vec()).unwrap_err();
    assert!(matches!(e, GgufError::Truncated { needed: 8, .. }), "{e}");
    names(&e, "metadata 'k'");
}

#[test]
fn truncated_tensor_table() {
    let b = valid().bytes();
    // Cut in the middle of tensor "b"'s dims.
    let tb = b
        .windows(9)
        .position(|w| w == [1, 0, 0, 0, 0, 0, 0, 0, b'b'])
        .expect("tensor b's name");
    let cut = tb + 9 + 4 + 4; // name, n_dims, half of dims[0]
    let e = GgufFile::from_bytes("bad.gguf", b[..cut].to_vec()).unwrap_err();
    assert!(matches!(e, GgufError::Truncated { needed: 8, .. }), "{e}");
    names(&e, "tensor 'b' dims[0]");
}

#[test]
fn truncated_data() {
    let b = valid().bytes();
    let e = GgufFile::from_bytes("bad.gguf", b[..b.len() - 10].to_vec()).unwrap_err();
    assert!(matches!(e, GgufError::Truncated { needed: 288, .. }), "{e}");
    let msg = names(&e, "tensor 'c' data");
    assert!(msg.contains("needs 288 bytes"), "{msg}");
}

#[test]
fn string_length_beyond_the_file() {
    let mut raw = valid();
    let mut v = Vec::new();
    v.extend_from_slice(&(1u64 << 40).to_le_bytes());
    v.extend_from_slice(b"abc");
    raw.kvs.insert(0, ("s".into(), ValueType::String as u32, v));
    let e = raw.err();
    assert!(
        matches!(e, GgufError::OutOfBounds { value, .. } if value == 1 << 40),
        "{e}"
    );
    let msg = names(&e, "metadata 's' (string length)");
    assert!(msg.contains("bytes are left"), "{msg}");
}

#[test]
fn array_length_beyond_the_file() {
    let mut raw = valid();
    let mut v = Vec::new();
    v.extend_from_slice(&(ValueType::U32 as u32).to_le_bytes());
    v.extend_from_slice(&u64::MAX.to_le_bytes());
    raw.kvs
        .insert(0, ("arr".into(), ValueType::Array as u32, v));
    let e = raw.err();
    assert!(
        matches!(
            e,
            GgufError::OutOfBounds {
                value: u64::MAX,
                ..
            }
        ),
        "{e}"
    );
    let msg = names(&e, "metadata 'arr' (array length)");
    assert!(msg.contains("U32 values fit"), "{msg}");
    // Nested: the inner array's length is checked against what is left.
    let mut raw = valid();
    let mut v = Vec::new();
    v.extend_from_slice(&(ValueType::Array as u32).to_le_bytes());
    v.extend_from_slice(&1u64.to_le_bytes());
    v.extend_from_slice(&(ValueType::String as u32).to_le_bytes());
    v.extend_from_slice(&(1u64 << 50).to_le_bytes());
    raw.kvs.push(("nest".into(), ValueType::Array as u32, v));
    let e = raw.err();
    assert!(matches!(e, GgufError::OutOfBounds { .. }), "{e}");
    names(&e, "metadata 'nest'[0] (array length)");
}

#[test]
fn counts_beyond_the_file() {
    let (b, lay) = valid().encode(None);
    for (pos, field) in [
        (lay.u64_fields[0], "tensor_count"),
        (lay.u64_fields[1], "metadata_kv_count"),
    ] {
        let mut m = b.clone();
        m[pos..pos + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        let e = GgufFile::from_bytes("bad.gguf", m).unwrap_err();
        assert!(matches!(e, GgufError::OutOfBounds { .. }), "{e}");
        names(&e, field);
    }
}

#[test]
fn tensor_offset_beyond_the_file() {
    let mut raw = valid();
    raw.tensors[1].offset = 1 << 20;
    let e = raw.err();
    assert!(
        matches!(e, GgufError::OutOfBounds { value, .. } if value == 1 << 20),
        "{e}"
    );
    let msg = names(&e, "tensor 'b' offset");
    assert!(msg.contains("data section"), "{msg}");
}

#[test]
fn tensor_size_beyond_the_file() {
    let mut raw = valid();
    raw.tensors[2].dims = vec![256, 1 << 20, 2];
    let e = raw.err();
    assert!(matches!(e, GgufError::OutOfBounds { .. }), "{e}");
    let msg = names(&e, "tensor 'c' size");
    assert!(msg.contains("Q4_K"), "{msg}");
}

#[test]
fn misaligned_tensor() {
    let mut raw = valid();
    raw.tensors[1].offset = 65;
    let e = raw.err();
    assert!(matches!(e, GgufError::Invalid { .. }), "{e}");
    let msg = names(&e, "tensor 'b' offset");
    assert!(msg.contains("multiple of the alignment 32"), "{msg}");
}

#[test]
fn overlapping_tensors() {
    let mut raw = valid();
    raw.tensors[2].offset = 128; // "b" spans 64..132
    let e = raw.err();
    assert!(matches!(e, GgufError::Invalid { .. }), "{e}");
    let msg = names(&e, "tensor 'c' offset");
    assert!(msg.contains("overlaps tensor 'b'"), "{msg}");
}

#[test]
fn dims_product_overflows() {
    let mut raw = valid();
    raw.tensors[0].dims = vec![1 << 32, 1 << 32, 2];
    let e = raw.err();
    assert!(matches!(e, GgufError::Invalid { .. }), "{e}");
    let msg = names(&e, "tensor 'a' dims");
    assert!(msg.contains("overflow"), "{msg}");
}

#[test]
fn shape_not_divisible_by_block_size() {
    let mut raw = valid();
    raw.tensors[1].dims = vec![48, 2];
    let e = raw.err();
    assert!(matches!(e, GgufError::Invalid { .. }), "{e}");
    let msg = names(&e, "tensor 'b' dims");
    assert!(msg.contains("block size 32"), "{msg}");
}

#[test]
fn duplicate_names() {
    let mut raw = valid();
    raw.tensors[2].name = "a".into();
    let e = raw.err();
    assert!(matches!(e, GgufError::Invalid { .. }), "{e}");
    let msg = names(&e, "tensor 'a'");
    assert!(msg.contains("appears twice"), "{msg}");

    let mut raw = valid();
    let dup = raw.kvs[3].clone();
    raw.kvs.push(dup);
    let e = raw.err();
    assert!(matches!(e, GgufError::Invalid { .. }), "{e}");
    let msg = names(&e, "metadata 't.i8'");
    assert!(msg.contains("appears twice"), "{msg}");
}

#[test]
fn bad_values_are_named() {
    // Unknown value type.
    let mut raw = valid();
    raw.kvs.push(("x".into(), 13, vec![0; 8]));
    let e = raw.err();
    names(&e, "metadata 'x' type");
    // Bool that is neither 0 nor 1.
    let mut raw = valid();
    raw.kvs.push(("x".into(), ValueType::Bool as u32, vec![2]));
    let e = raw.err();
    assert!(e.to_string().contains("expected 0 or 1"), "{e}");
    names(&e, "metadata 'x'");
    // Invalid UTF-8.
    let mut raw = valid();
    raw.kvs.push(kv("x", &Value::String("ab".into())));
    raw.kvs.last_mut().unwrap().2[8] = 0xff;
    names(&raw.err(), "metadata 'x'");
    // Alignment that is not a U32 power of two.
    for v in [Value::U32(48), Value::U32(0), Value::U64(32)] {
        let mut raw = valid();
        raw.kvs[1] = kv("general.alignment", &v);
        let e = raw.err();
        assert!(matches!(e, GgufError::Invalid { .. }), "{e}");
        let msg = names(&e, "metadata 'general.alignment'");
        assert!(msg.contains("U32 power of two"), "{msg}");
    }
    // Arrays nested too deep.
    let mut v = Value::Array(ValueType::U8, vec![]);
    for _ in 0..9 {
        v = Value::Array(ValueType::Array, vec![v]);
    }
    let mut raw = valid();
    raw.kvs.push(kv("deep", &v));
    let e = raw.err();
    assert!(e.to_string().contains("nested deeper"), "{e}");
    // n_dims out of range.
    for dims in [vec![], vec![1, 1, 1, 1, 32]] {
        let mut raw = valid();
        raw.tensors[0].dims = dims;
        names(&raw.err(), "tensor 'a' n_dims");
    }
}

#[test]
fn unknown_tensor_type_names_tensor_and_type() {
    let mut raw = valid();
    raw.tensors[1].ty = 4; // removed Q4_2
    let e = raw.err();
    match &e {
        GgufError::UnsupportedType { tensor, ty, .. } => {
            assert_eq!(tensor, "b");
            assert_eq!(ty, "id 4");
        }
        other => panic!("expected UnsupportedType, got {other}"),
    }
    assert!(e.to_string().contains("bad.gguf"));
}

#[test]
fn check_supported_names_tensor_and_type() {
    let f = GgufFile::from_bytes("bad.gguf", valid().bytes()).expect("valid");
    let c = f.tensor("c").expect("c");
    assert!(f
        .check_supported(c, &[GgmlType::Q4_K, GgmlType::F32])
        .is_ok());
    let e = f
        .check_supported(c, &[GgmlType::F32, GgmlType::Q8_0])
        .unwrap_err();
    assert!(matches!(e, GgufError::UnsupportedType { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("'c'") && msg.contains("Q4_K"), "{msg}");
    assert!(msg.contains("supported here: F32, Q8_0"), "{msg}");
    assert!(msg.contains("bad.gguf"), "{msg}");
}

#[test]
fn empty_file_is_truncated_at_the_magic() {
    let dir = scratch("empty");
    let p = dir.join("bad.gguf");
    std::fs::write(&p, b"").expect("write");
    let e = GgufFile::open(&p).unwrap_err();
    assert!(
        matches!(
            e,
            GgufError::Truncated {
                needed: 4,
                offset: 0,
                file_len: 0,
                ..
            }
        ),
        "{e}"
    );
    names(&e, "magic");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn missing_file_is_an_open_error() {
    let e = GgufFile::open("/nonexistent/bad.gguf").unwrap_err();
    assert!(matches!(e, GgufError::Open { .. }), "{e}");
    assert!(e.to_string().contains("/nonexistent/bad.gguf"));
}

#[test]
fn missing_split_shard() {
    let dir = scratch("missing-shard");
    let meta = vec![(
        "general.architecture".to_string(),
        Value::String("x".into()),
    )];
    let tensors: Vec<(TensorSpec, Vec<u8>)> = (0..3)
        .map(|i| {
            (
                TensorSpec::new(format!("t{i}"), &[4], GgmlType::F32),
                vec![i as u8; 16],
            )
        })
        .collect();
    let paths =
        bmoe_engine::gguf::GgufSplitWriter::write_files(dir.join("bad"), &meta, &tensors, 1)
            .expect("write split");
    assert_eq!(paths.len(), 3);
    std::fs::remove_file(&paths[1]).expect("remove shard 2");
    for open_from in [&paths[0], &paths[2]] {
        let e = GgufFile::open(open_from).unwrap_err();
        match &e {
            GgufError::MissingShard {
                index,
                count,
                expected,
                ..
            } => {
                assert_eq!((*index, *count), (2, 3));
                assert_eq!(expected, &paths[1]);
            }
            other => panic!("expected MissingShard, got {other}"),
        }
        let msg = e.to_string();
        assert!(msg.contains("bad-00002-of-00003.gguf"), "{msg}");
        assert_eq!(e.field(), Some("split.count"));
    }
    // In memory: the first shard alone is missing shards 2 and 3.
    let first = std::fs::read(&paths[0]).expect("read");
    let e = GgufFile::from_bytes(&paths[0], first).unwrap_err();
    assert!(
        matches!(
            e,
            GgufError::MissingShard {
                index: 2,
                count: 3,
                ..
            }
        ),
        "{e}"
    );
    // And the writer refuses to write a file it would not read back.
    let e = GgufWriter::create(
        dir.join("w.gguf"),
        &[],
        vec![TensorSpec::new("x", &[33], GgmlType::Q8_0)],
    )
    .err()
    .expect("bad shape refused");
    assert_eq!(e.field(), Some("tensor 'x' dims"));
    std::fs::remove_dir_all(&dir).ok();
}

/// The valid sample re-encoded with `general.alignment` = `alignment` and the header's
/// tensor_count moved by `delta`.
fn with_count_delta(alignment: u32, delta: i64) -> Vec<u8> {
    let mut raw = valid();
    raw.alignment = u64::from(alignment);
    for kv in raw.kvs.iter_mut() {
        if kv.0 == "general.alignment" {
            *kv = super::common::kv("general.alignment", &Value::U32(alignment));
        }
    }
    for (i, t) in raw.tensors.iter_mut().enumerate() {
        t.offset = (i as u64) * 512u64.max(u64::from(alignment));
    }
    let step = 512usize.max(alignment as usize);
    raw.data = (0..(2 * step + 288)).map(|i| (i * 7 + 1) as u8).collect();
    let (mut b, lay) = raw.encode(None);
    let pos = lay.u64_fields[0];
    let n = u64::from_le_bytes(b[pos..pos + 8].try_into().unwrap());
    b[pos..pos + 8].copy_from_slice(&(n as i64 + delta).to_le_bytes());
    b
}

#[test]
fn a_header_tensor_count_off_by_one_is_refused() {
    // The bug: a count one too small shifted every tensor's data and the model produced NaN
    // logits with exit 0. Every alignment, so the shift is sometimes 0 and sometimes more.
    for alignment in [1u32, 8, 32, 64, 256, 4096] {
        assert!(
            GgufFile::from_bytes("bad.gguf", with_count_delta(alignment, 0)).is_ok(),
            "the unmodified sample at alignment {alignment} parses"
        );
        for delta in [-1i64, 1] {
            let e = GgufFile::from_bytes("bad.gguf", with_count_delta(alignment, delta))
                .expect_err("a tensor_count off by one must be refused");
            let msg = names(&e, "tensor_count");
            let hint = if delta < 0 { "too small" } else { "too large" };
            assert!(
                msg.contains(hint),
                "alignment {alignment}, {delta:+}: {msg}"
            );
        }
    }
}

#[test]
fn bytes_after_the_last_tensor_are_refused() {
    let mut raw = valid();
    raw.data.extend_from_slice(&[0u8; 32]);
    let msg = names(&raw.err(), "tensor_count");
    assert!(msg.contains("32 more bytes"), "{msg}");
    // Padding shorter than the alignment is what writers leave.
    let mut raw = valid();
    raw.data.extend_from_slice(&[0u8; 31]);
    GgufFile::from_bytes("ok.gguf", raw.bytes()).expect("31 bytes of padding");
}

#[test]
fn a_directory_is_not_a_gguf_file() {
    let dir = scratch("dir-as-model");
    let e = GgufFile::open(&dir).unwrap_err();
    assert!(matches!(e, GgufError::NotAFile { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("is a directory"), "{msg}");
    assert!(!msg.contains("No such device"), "{msg}");
    std::fs::remove_dir_all(&dir).ok();
}
