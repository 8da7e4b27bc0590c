//! An independent reader agrees: llama.cpp's gguf-py (PyPI `gguf`, via
//! scripts/gguf_check.py) and our reader see the same header, tensors and metadata.
//! Skips with a message when python3 or the package is missing, except under `CI=true`.

use super::common::*;
use bmoe_engine::gguf::{
    GgmlType, GgufFile, GgufSplitWriter, GgufWriter, TensorSpec, Value, ValueType,
};
use serde_json::Value as Json;
use std::path::Path;
use std::process::Command;

fn python_has_gguf() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import gguf"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        if in_ci() {
            panic!("CI=true but `python3 -c \"import gguf\"` fails: pip install gguf");
        }
        eprintln!("skipping: python3 with the gguf package is not available (pip install gguf)");
    }
    ok
}

fn gguf_check(path: &Path) -> Json {
    let script = bmoe_engine::testdata::project_root().join("scripts/gguf_check.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(path)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "gguf_check.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("gguf_check.py prints JSON")
}

/// gguf-py's name for a value type.
fn py_type(t: ValueType) -> &'static str {
    match t {
        ValueType::U8 => "UINT8",
        ValueType::I8 => "INT8",
        ValueType::U16 => "UINT16",
        ValueType::I16 => "INT16",
        ValueType::U32 => "UINT32",
        ValueType::I32 => "INT32",
        ValueType::F32 => "FLOAT32",
        ValueType::Bool => "BOOL",
        ValueType::String => "STRING",
        ValueType::Array => "ARRAY",
        ValueType::U64 => "UINT64",
        ValueType::I64 => "INT64",
        ValueType::F64 => "FLOAT64",
    }
}

fn fnv1a64(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn float_matches(x: f64, j: &Json) -> bool {
    match j {
        Json::String(s) => {
            (s == "nan" && x.is_nan())
                || (s == "inf" && x == f64::INFINITY)
                || (s == "-inf" && x == f64::NEG_INFINITY)
        }
        j => j.as_f64() == Some(x),
    }
}

/// Compare one of our values with gguf_check.py's rendering of it (a bare value, or an
/// array summary). `top` arrays carry the hash of their stored bytes.
fn same(key: &str, ours: &Value, theirs: &Json, top: bool) {
    let ok = match ours {
        Value::U8(v) => theirs.as_u64() == Some(u64::from(*v)),
        Value::U16(v) => theirs.as_u64() == Some(u64::from(*v)),
        Value::U32(v) => theirs.as_u64() == Some(u64::from(*v)),
        Value::U64(v) => theirs.as_u64() == Some(*v),
        Value::I8(v) => theirs.as_i64() == Some(i64::from(*v)),
        Value::I16(v) => theirs.as_i64() == Some(i64::from(*v)),
        Value::I32(v) => theirs.as_i64() == Some(i64::from(*v)),
        Value::I64(v) => theirs.as_i64() == Some(*v),
        Value::F32(v) => float_matches(f64::from(*v), theirs),
        Value::F64(v) => float_matches(*v, theirs),
        Value::Bool(v) => theirs.as_bool() == Some(*v),
        Value::String(s) => theirs.as_str() == Some(s.as_str()),
        Value::Array(t, items) => {
            assert_eq!(theirs["type"], "ARRAY", "{key}");
            assert_eq!(theirs["element_type"], py_type(*t), "{key}");
            assert_eq!(theirs["len"].as_u64(), Some(items.len() as u64), "{key}");
            let first = theirs["first"].as_array().expect("first");
            assert_eq!(first.len(), items.len().min(8), "{key}");
            for (i, (a, b)) in items.iter().zip(first).enumerate() {
                same(&format!("{key}[{i}]"), a, b, false);
            }
            if top {
                let mut enc = Vec::new();
                ours.encode_into(&mut enc);
                assert_eq!(
                    theirs["fnv1a64"].as_str(),
                    Some(fnv1a64(&enc).as_str()),
                    "{key}"
                );
            }
            true
        }
    };
    assert!(ok, "{key}: ours {ours:?}, gguf-py {theirs}");
}

/// Our reading of `f`'s shard `shard` against gguf-py's reading of that file.
fn agree(f: &GgufFile, shard: usize, py: &Json, check_metadata: bool) {
    assert_eq!(py["version"].as_u64(), Some(u64::from(f.version())));
    assert_eq!(py["alignment"].as_u64(), f.shard_alignment(shard));
    assert_eq!(py["data_offset"].as_u64(), f.shard_data_start(shard));
    let ours: Vec<_> = f
        .tensors()
        .iter()
        .filter(|t| t.shard as usize == shard)
        .collect();
    let theirs = py["tensors"].as_array().expect("tensors");
    assert_eq!(theirs.len(), ours.len());
    for (t, p) in ours.iter().zip(theirs) {
        assert_eq!(p["name"], t.name.as_str());
        assert_eq!(p["type"], t.ty.name(), "{}", t.name);
        let shape: Vec<u64> = p["shape"]
            .as_array()
            .expect("shape")
            .iter()
            .map(|d| d.as_u64().expect("dim"))
            .collect();
        assert_eq!(shape, t.dims, "{}", t.name);
        assert_eq!(p["offset"].as_u64(), Some(t.offset), "{}", t.name);
        assert_eq!(p["n_bytes"].as_u64(), Some(t.n_bytes), "{}", t.name);
    }
    if check_metadata {
        let md = py["metadata"].as_object().expect("metadata");
        let keys: Vec<&str> = py["metadata_keys"]
            .as_array()
            .expect("metadata_keys")
            .iter()
            .map(|k| k.as_str().expect("key"))
            .collect();
        let our_keys: Vec<&str> = f.metadata().iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, our_keys, "metadata keys and order");
        for (k, v) in f.metadata() {
            let p = &md[k];
            match v {
                Value::Array(..) => same(k, v, p, true),
                _ => {
                    assert_eq!(p["type"], py_type(v.value_type()), "{k}");
                    same(k, v, &p["value"], true);
                }
            }
        }
    }
}

/// Every value type, nested arrays, a tokenizer-sized token list, and tensors of every
/// type gguf-py sizes as ggml does (Q8_1 differs there and never appears in files; the
/// newest types may be missing from an older gguf-py).
fn rich_model() -> Model {
    let mut meta = sample_metadata();
    meta[1].1 = Value::U32(64); // general.alignment
    let tokens: Vec<String> = (0..5000).map(|i| format!("tok{i}")).collect();
    meta.push(("tokenizer.ggml.tokens".into(), Value::strings(&tokens)));
    meta.push((
        "tokenizer.ggml.scores".into(),
        Value::Array(
            ValueType::F32,
            (0..5000).map(|i| Value::F32(i as f32 * -0.5)).collect(),
        ),
    ));
    meta.push((
        "t.special_floats".into(),
        Value::Array(
            ValueType::F64,
            vec![
                Value::F64(f64::NAN),
                Value::F64(f64::INFINITY),
                Value::F64(f64::NEG_INFINITY),
                Value::F64(-0.0),
            ],
        ),
    ));
    meta.push(("t.nan32".into(), Value::F32(f32::NAN)));
    meta.push((
        "tokenizer.chat_template".into(),
        Value::String("{% for m in messages %}{{ m.content }}{% endfor %}".into()),
    ));
    let skip = [GgmlType::Q8_1, GgmlType::NVFP4, GgmlType::Q1_0];
    let tensors = GgmlType::all()
        .filter(|t| !skip.contains(t))
        .enumerate()
        .map(|(i, ty)| {
            let s = TensorSpec::new(
                format!("blk.{i}.{}", ty.name().to_lowercase()),
                &[ty.block_size(), 2, 3],
                ty,
            );
            let n = s.n_bytes().expect("valid") as usize;
            (s, (0..n).map(|j| (j + i) as u8).collect())
        })
        .collect();
    (meta, tensors)
}

#[test]
fn gguf_py_agrees_with_our_reader() {
    if !python_has_gguf() {
        return;
    }
    let dir = scratch("python");
    let (meta, tensors) = rich_model();
    let path = dir.join("rich.gguf");
    GgufWriter::write_file(&path, &meta, &tensors).expect("write");
    let f = GgufFile::open(&path).expect("open");
    assert_eq!(f.alignment(), 64);
    let py = gguf_check(&path);
    agree(&f, 0, &py, true);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn gguf_py_agrees_on_every_shard_of_a_split_model() {
    if !python_has_gguf() {
        return;
    }
    let dir = scratch("python-split");
    let (meta, tensors) = rich_model();
    let paths = GgufSplitWriter::write_files(dir.join("rich"), &meta, &tensors, 10).expect("write");
    assert!(paths.len() >= 3);
    let f = GgufFile::open(&paths[0]).expect("open");
    for (i, p) in paths.iter().enumerate() {
        let py = gguf_check(p);
        agree(&f, i, &py, i == 0);
        let md = py["metadata"].as_object().expect("metadata");
        assert_eq!(md["split.no"]["type"], "UINT16");
        assert_eq!(md["split.no"]["value"].as_u64(), Some(i as u64));
        assert_eq!(md["split.count"]["type"], "UINT16");
        assert_eq!(
            md["split.count"]["value"].as_u64(),
            Some(paths.len() as u64)
        );
        assert_eq!(md["split.tensors.count"]["type"], "INT32");
        assert_eq!(
            md["split.tensors.count"]["value"].as_u64(),
            Some(tensors.len() as u64)
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
