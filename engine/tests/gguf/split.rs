//! Split models: written as llama.cpp's gguf-split names and keys them, read back as one
//! model from any shard, with tensors located in the right shard.

use super::common::*;
use bmoe_engine::gguf::{
    plan_split, split_path, GgmlType, GgufError, GgufFile, GgufSplitWriter, TensorSpec, Value,
};
use std::os::unix::fs::FileExt;

fn model() -> Model {
    let meta = sample_metadata();
    let specs = [
        TensorSpec::new("token_embd.weight", &[64, 10], GgmlType::Q8_0),
        TensorSpec::new("blk.0.attn_norm.weight", &[64], GgmlType::F32),
        TensorSpec::new("blk.0.ffn_gate_exps.weight", &[256, 4, 8], GgmlType::Q4_K),
        TensorSpec::new("blk.0.ffn_up_exps.weight", &[256, 4, 8], GgmlType::Q4_K),
        TensorSpec::new("blk.0.ffn_down_exps.weight", &[32, 8, 8], GgmlType::Q8_0),
        TensorSpec::new("output_norm.weight", &[64], GgmlType::F32),
    ];
    let tensors = specs
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.n_bytes().expect("valid") as usize;
            let d = (0..n).map(|j| (j * 31 + i * 7) as u8).collect();
            (s, d)
        })
        .collect();
    (meta, tensors)
}

/// Every tensor of `f` has `want`'s bytes, both through the map and through a `pread` of
/// its extent on its shard's file; returns the shard of each tensor.
fn check_tensors(f: &GgufFile, want: &[(TensorSpec, Vec<u8>)]) -> Vec<u16> {
    assert_eq!(f.tensors().len(), want.len());
    let files: Vec<std::fs::File> = f
        .shard_paths()
        .iter()
        .map(|p| std::fs::File::open(p).expect("shard"))
        .collect();
    want.iter()
        .map(|(spec, data)| {
            let t = f.tensor(&spec.name).expect("tensor present");
            assert_eq!((&t.dims, t.ty), (&spec.dims, spec.ty));
            assert_eq!(f.tensor_data(t), &data[..], "{}", spec.name);
            let e = t.extent();
            let mut buf = vec![0u8; e.len as usize];
            files[e.shard as usize]
                .read_exact_at(&mut buf, e.offset)
                .expect("pread");
            assert_eq!(buf, *data, "pread of {}", spec.name);
            t.shard
        })
        .collect()
}

#[test]
fn split_model_reads_as_one_from_any_shard() {
    let dir = scratch("split");
    let (meta, tensors) = model();
    let paths = GgufSplitWriter::write_files(dir.join("m"), &meta, &tensors, 2).expect("write");
    let names: Vec<String> = paths
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "m-00001-of-00003.gguf",
            "m-00002-of-00003.gguf",
            "m-00003-of-00003.gguf"
        ]
    );
    for open_from in &paths {
        let f = GgufFile::open(open_from).expect("open split");
        assert_eq!(f.shard_count(), 3);
        assert_eq!(
            f.shard_paths(),
            paths.iter().map(|p| p.as_path()).collect::<Vec<_>>()
        );
        assert_eq!(check_tensors(&f, &tensors), [0, 0, 1, 1, 2, 2]);
        // The model's metadata is the first shard's: everything given, then the split keys
        // with gguf-split's types.
        let (given, split) = f.metadata().split_at(meta.len());
        assert!(given
            .iter()
            .zip(&meta)
            .all(|(a, b)| a.0 == b.0 && a.1.bits_eq(&b.1)));
        assert_eq!(
            split,
            [
                ("split.no".to_string(), Value::U16(0)),
                ("split.count".to_string(), Value::U16(3)),
                ("split.tensors.count".to_string(), Value::I32(6)),
            ]
        );
    }
    // Shards after the first carry only the split keys.
    for (i, p) in paths.iter().enumerate() {
        let b = std::fs::read(p).expect("read");
        let has = |s: &[u8]| b.windows(s.len()).any(|w| w == s);
        assert!(has(b"split.no") && has(b"split.count") && has(b"split.tensors.count"));
        assert_eq!(has(b"general.architecture"), i == 0, "shard {i}");
    }
    // In memory, in order, the shards read the same.
    let shards: Vec<_> = paths
        .iter()
        .map(|p| (p.clone(), std::fs::read(p).expect("read")))
        .collect();
    let g = GgufFile::from_shard_bytes(shards.clone()).expect("from bytes");
    assert_eq!(
        g.tensors(),
        GgufFile::open(&paths[0]).expect("open").tensors()
    );
    // Out of order, they do not.
    let mut swapped = shards;
    swapped.swap(1, 2);
    let e = GgufFile::from_shard_bytes(swapped).unwrap_err();
    assert!(matches!(e, GgufError::Invalid { .. }), "{e}");
    assert_eq!(e.field(), Some("metadata 'split.no'"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn one_expert_of_a_stacked_tensor_is_one_pread() {
    let dir = scratch("split-expert");
    let (meta, tensors) = model();
    let paths = GgufSplitWriter::write_files(dir.join("m"), &meta, &tensors, 2).expect("write");
    let f = GgufFile::open(&paths[1]).expect("open");
    let t = f.tensor("blk.0.ffn_down_exps.weight").expect("down");
    assert_eq!(t.shard, 2);
    assert_eq!(t.n_slices(), Some(8));
    let per_expert = t.slice_bytes().expect("slice bytes");
    assert_eq!(per_expert, t.row_bytes() * 8);
    let want = &tensors[4].1;
    let file = std::fs::File::open(&paths[2]).expect("shard 3");
    for e in 0..8u64 {
        let x = t.slice_extent(e).expect("extent");
        let mut buf = vec![0u8; x.len as usize];
        file.read_exact_at(&mut buf, x.offset).expect("pread");
        let lo = (e * per_expert) as usize;
        assert_eq!(buf, want[lo..lo + per_expert as usize], "expert {e}");
        assert_eq!(f.extent_data(x), &buf[..]);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn streamed_split_by_size_with_an_empty_first_shard() {
    let dir = scratch("split-stream");
    let (meta, tensors) = model();
    let specs: Vec<TensorSpec> = tensors.iter().map(|t| t.0.clone()).collect();
    let by_size = plan_split(specs.clone(), 128, Some(1200));
    assert!(by_size.len() > 1 && by_size.iter().all(|s| !s.is_empty()));
    assert_eq!(by_size.concat(), specs);
    // As gguf-split --no-tensor-first-split: metadata only in the first shard.
    let mut plan = vec![Vec::new()];
    plan.extend(by_size);
    let count = plan.len() as u32;
    let mut w = GgufSplitWriter::create(dir.join("s"), &meta, plan).expect("create");
    for (spec, data) in &tensors {
        assert_eq!(w.next_spec(), Some(spec));
        w.write_tensor(data).expect("write");
    }
    assert_eq!(w.next_spec(), None);
    let (paths, total_bytes) = w.finish().expect("finish");
    assert_eq!(paths.len() as u32, count);
    assert_eq!(paths[0], split_path(&dir.join("s"), 0, count));
    let on_disk: u64 = paths
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert_eq!(total_bytes, on_disk);
    let f = GgufFile::open(&paths[0]).expect("open");
    assert_eq!(f.file_bytes(), on_disk);
    let shards = check_tensors(&f, &tensors);
    assert!(shards.iter().all(|&s| s > 0));
    assert_eq!(f.tensors().iter().filter(|t| t.shard == 0).count(), 0);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn split_keys_are_checked() {
    let dir = scratch("split-keys");
    let (meta, tensors) = model();
    // The split writer owns the split keys.
    let mut m2 = meta.clone();
    m2.push(("split.count".into(), Value::U16(2)));
    let e = GgufSplitWriter::write_files(dir.join("x"), &m2, &tensors, 2).unwrap_err();
    assert_eq!(e.field(), Some("metadata 'split.count'"));
    // A shard renamed so its name disagrees with its keys.
    let paths = GgufSplitWriter::write_files(dir.join("m"), &meta, &tensors, 3).expect("write");
    assert_eq!(paths.len(), 2);
    let renamed = dir.join("m-00002-of-00002.gguf.bak");
    std::fs::rename(&paths[1], &renamed).expect("rename");
    std::fs::copy(&paths[0], &paths[1]).expect("copy");
    let e = GgufFile::open(&paths[1]).unwrap_err();
    assert!(matches!(e, GgufError::Invalid { .. }), "{e}");
    assert_eq!(e.field(), Some("metadata 'split.no'"));
    assert!(e.to_string().contains("file name says shard 2 of 2"), "{e}");
    // split.tensors.count must match the tensors found, with gguf-split's type.
    for v in [Value::I32(5), Value::U32(3)] {
        let mut raw = valid();
        raw.kvs.push(kv("split.count", &Value::U16(1)));
        raw.kvs.push(kv("split.no", &Value::U16(0)));
        raw.kvs.push(kv("split.tensors.count", &v));
        let e = raw.err();
        assert!(matches!(e, GgufError::Invalid { .. }), "{e}");
        assert_eq!(e.field(), Some("metadata 'split.tensors.count'"));
        assert!(e.to_string().contains("expected I32 3"), "{e}");
    }
    // split.count of the wrong type, as llama.cpp's loader would refuse it.
    let mut raw = valid();
    raw.kvs.push(kv("split.count", &Value::U32(1)));
    let e = raw.err();
    assert_eq!(e.field(), Some("metadata 'split.count'"));
    assert!(e.to_string().contains("expected a U16"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
