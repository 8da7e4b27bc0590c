//! `LaneFlash` against real files: bytes land where the arena says, in every mode and lane
//! count, each outcome is delivered once, cancels and faults behave as the `Flash` contract
//! says. Files live under the worktree's `target/` (via `CARGO_TARGET_TMPDIR`), not /tmp,
//! which may be tmpfs and refuse O_DIRECT; the fallback test seeks out tmpfs on purpose.

use bmoe_core::backend::SlotId;
use bmoe_core::flash::{Flash, FlashError, ReadRequest, ReadTag};
use bmoe_core::layout::ExpertKey;
use bmoe_core::testing::{Fault, FaultyFlash};
use bmoe_engine::arena::{Arena, Extent, SlotAddr, ALIGN};
use bmoe_engine::flash::{raw_read_bench, FlashOpenError, LaneFlash, MonotonicClock, RawIo};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Projection lengths of the test arena's layer 0 (unaligned on purpose) and layer 1.
const PROJ_LENS: [u64; 3] = [5_000, 12_345, 70_001];
const N_EXPERT: u32 = 16;
const N_STAGING: u32 = 4;

fn tmp_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("flash-tests")
        .join(name);
    std::fs::create_dir_all(&d).expect("create test dir under target/");
    d
}

/// A file of `len` seeded random bytes at `dir/name`.
fn random_file(dir: &Path, name: &str, len: usize, seed: u64) -> (PathBuf, Vec<u8>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut bytes = vec![0u8; len];
    rng.fill(&mut bytes[..]);
    let p = dir.join(name);
    std::fs::write(&p, &bytes).expect("write test file");
    (p, bytes)
}

fn arena() -> Arc<Arena> {
    Arc::new(
        Arena::new(
            &[
                (N_EXPERT, PROJ_LENS.to_vec()),
                (N_EXPERT, vec![300, 4096, 9000]),
            ],
            N_STAGING,
        )
        .expect("reserve arena"),
    )
}

fn tag(layer: u16, expert: u16, proj: u8) -> ReadTag {
    ReadTag {
        layer,
        expert,
        proj,
    }
}

fn canonical(layer: u16, expert: u16) -> SlotId {
    SlotId::Canonical(ExpertKey { layer, expert })
}

fn addr(slot: SlotId) -> SlotAddr {
    match slot {
        SlotId::Canonical(k) => SlotAddr::Canonical(u32::from(k.expert)),
        SlotId::Staging(e) => SlotAddr::Staging(u32::from(e)),
    }
}

/// One whole-projection read request.
fn request(
    slot: SlotId,
    layer: u16,
    expert: u16,
    proj: u8,
    offset: u64,
    len: u64,
    lane: u32,
) -> ReadRequest {
    ReadRequest {
        shard: 0,
        offset,
        len,
        dest: slot,
        dest_offset: 0,
        lane,
        speculative: false,
        tag: tag(layer, expert, proj),
    }
}

fn projection(arena: &Arena, layer: u16, slot: SlotId, proj: u8, offset: u64, len: u64) -> Vec<u8> {
    let ext = Extent {
        shard: 0,
        offset,
        len,
    };
    // SAFETY: every read into this slot has been delivered and none is in flight.
    unsafe { arena.proj_bytes(layer as usize, addr(slot), proj as usize, &ext) }
        .expect("the slot was read into")
        .to_vec()
}

fn open(paths: &[PathBuf], lanes: u32, direct: bool, arena: &Arc<Arena>) -> LaneFlash {
    LaneFlash::open(paths, lanes, direct, arena.clone(), MonotonicClock::new())
        .expect("open LaneFlash")
}

/// Random whole-projection extents (unaligned offsets and lengths, some ending at the last
/// byte of the file), in batches into distinct slots, checked byte for byte; half the
/// batches are delivered by `wait`, half by `poll`.
fn random_extents(lanes: u32, direct: bool, seed: u64) {
    let dir = tmp_dir("random");
    let file_len = 3 * 1024 * 1024 + 1234;
    let (path, bytes) = random_file(&dir, &format!("shard-{seed}.bin"), file_len, seed);
    let arena = arena();
    let mut dev = open(std::slice::from_ref(&path), lanes, direct, &arena);
    assert_eq!(dev.lanes(), lanes);
    if direct {
        assert!(
            dev.o_direct_achieved(),
            "target/ should support O_DIRECT: {:?}",
            dev.warnings()
        );
    } else {
        assert!(!dev.o_direct_achieved());
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    let mut lane = 0u32;
    for batch in 0..12 {
        // One read per (expert, proj) in this batch so destinations never overlap.
        let mut reads = Vec::new();
        for expert in 0..N_EXPERT as u16 {
            for proj in 0..3u8 {
                let len = PROJ_LENS[proj as usize];
                let max_off = file_len as u64 - len;
                let offset = match rng.gen_range(0..6) {
                    0 => max_off,                                    // the file's last bytes
                    1 => rng.gen_range(0..=max_off / ALIGN) * ALIGN, // aligned
                    _ => rng.gen_range(0..=max_off),
                };
                let slot = if expert < N_STAGING as u16 && batch % 3 == 0 {
                    SlotId::Staging(expert)
                } else {
                    canonical(0, expert)
                };
                let req = request(slot, 0, expert, proj, offset, len, lane);
                lane = (lane + 1) % lanes;
                reads.push((dev.submit(req), req));
            }
        }
        let mut seen = HashSet::new();
        if batch % 2 == 0 {
            for (id, req) in &reads {
                let done = dev.wait(*id).expect("read succeeds");
                check_done(&done, req, direct);
                assert!(seen.insert(*id));
            }
        } else {
            while seen.len() < reads.len() {
                match dev.poll() {
                    Some((id, outcome)) => {
                        let done = outcome.expect("read succeeds");
                        let req = reads.iter().find(|r| r.0 == id).expect("known id").1;
                        check_done(&done, &req, direct);
                        assert!(seen.insert(id), "{id} delivered twice");
                    }
                    None => std::thread::yield_now(),
                }
            }
        }
        // Exactly once: a second wait is refused and nothing is left to poll.
        let (first, _) = reads[0];
        assert_eq!(dev.wait(first), Err(FlashError::UnknownRead { id: first }));
        assert!(dev.poll().is_none());
        for (_, req) in &reads {
            let got = projection(&arena, 0, req.dest, req.tag.proj, req.offset, req.len);
            let want = &bytes[req.offset as usize..(req.offset + req.len) as usize];
            assert!(
                got == want,
                "seed {seed} lanes {lanes} direct {direct}: bytes of {req:?} differ"
            );
        }
    }
}

fn check_done(done: &bmoe_core::flash::ReadDone, req: &ReadRequest, direct: bool) {
    assert_eq!(done.req_bytes, req.len);
    assert_eq!(done.lane, req.lane);
    assert!(done.read_bytes >= done.req_bytes);
    if direct {
        assert_eq!(done.read_bytes % ALIGN, 0);
        let lo = req.offset / ALIGN * ALIGN;
        let hi = (req.offset + req.len).div_ceil(ALIGN) * ALIGN;
        assert_eq!(done.read_bytes, hi - lo);
    } else {
        assert_eq!(done.read_bytes, req.len);
    }
    assert!(done.submit <= done.start && done.start <= done.end);
}

#[test]
fn random_extents_one_lane_direct() {
    random_extents(1, true, 1);
}

#[test]
fn random_extents_four_lanes_direct() {
    random_extents(4, true, 2);
}

#[test]
fn random_extents_one_lane_buffered() {
    random_extents(1, false, 3);
}

#[test]
fn random_extents_four_lanes_buffered() {
    random_extents(4, false, 4);
}

/// The core splits an extent at `max_read_bytes`: piece `k` reads `offset = extent + done`
/// with `dest_offset = done`. The assembled projection must equal the file's extent, in both
/// modes, for chunk sizes aligned and not, and extents starting anywhere in a page.
#[test]
fn split_reads_assemble_the_extent() {
    let dir = tmp_dir("split");
    let file_len = 1024 * 1024 + 77;
    let (path, bytes) = random_file(&dir, "shard.bin", file_len, 11);
    let arena = arena();
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for direct in [true, false] {
        for lanes in [1u32, 3] {
            let mut dev = open(std::slice::from_ref(&path), lanes, direct, &arena);
            for (i, chunk) in [4096u64, 1000, 8192, 12_345, 333].into_iter().enumerate() {
                let expert = i as u16;
                let len = PROJ_LENS[2];
                let base = if i == 0 {
                    file_len as u64 - len
                } else {
                    rng.gen_range(0..=file_len as u64 - len)
                };
                let slot = canonical(0, expert);
                let mut ids = Vec::new();
                let mut done = 0u64;
                let mut lane = 0;
                while done < len {
                    let n = chunk.min(len - done);
                    let mut req = request(slot, 0, expert, 2, base + done, n, lane);
                    req.dest_offset = done;
                    ids.push(dev.submit(req));
                    lane = (lane + 1) % lanes;
                    done += n;
                }
                for id in ids {
                    dev.wait(id).expect("piece read succeeds");
                }
                let got = projection(&arena, 0, slot, 2, base, len);
                assert!(
                    got == bytes[base as usize..(base + len) as usize],
                    "direct {direct} lanes {lanes} chunk {chunk} base {base}: assembled bytes differ"
                );
            }
        }
    }
}

/// A speculative read queued behind a busy lane is cancelled: `cancel` says so, and its
/// outcome is never delivered. A demand read is never cancelled, and a finished read is not
/// cancellable.
#[test]
fn cancel_queued_speculative_read() {
    let dir = tmp_dir("cancel");
    let (path, _) = random_file(&dir, "shard.bin", 4 * 1024 * 1024, 21);
    // Many slots of 64 KiB projections to keep the single lane busy.
    let arena = Arc::new(Arena::new(&[(256, vec![65_536])], 1).expect("arena"));
    let mut dev = open(std::slice::from_ref(&path), 1, true, &arena);
    let mut ids = Vec::new();
    for e in 0..200u16 {
        let off = u64::from(e) * 65_536 % (4 * 1024 * 1024 - 65_536);
        ids.push(dev.submit(request(canonical(0, e), 0, e, 0, off, 65_536, 0)));
    }
    let mut spec = request(canonical(0, 250), 0, 250, 0, 4096, 65_536, 0);
    spec.speculative = true;
    let spec_id = dev.submit(spec);
    let demand = dev.submit(request(canonical(0, 251), 0, 251, 0, 8192, 65_536, 0));
    assert!(!dev.cancel(demand), "demand reads are not cancellable");
    assert!(
        dev.cancel(spec_id),
        "a read queued behind 200 others has not started"
    );
    assert!(
        !dev.cancel(spec_id),
        "a cancelled read cannot be cancelled twice"
    );
    assert_eq!(
        dev.wait(spec_id),
        Err(FlashError::UnknownRead { id: spec_id })
    );
    for id in ids {
        dev.wait(id).expect("read succeeds");
    }
    dev.wait(demand).expect("demand read succeeds");
    assert!(
        dev.poll().is_none(),
        "the cancelled read must not be delivered"
    );
    // A finished speculative read cannot be cancelled; its outcome is still delivered.
    let mut spec2 = request(canonical(0, 252), 0, 252, 0, 0, 65_536, 0);
    spec2.speculative = true;
    let id2 = dev.submit(spec2);
    // Let the idle lane pick it up; whatever the timing, once the lane has popped it the
    // read is not cancellable, and a 64 KiB read on an idle lane starts well within this.
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(!dev.cancel(id2));
    assert!(dev.wait(id2).is_ok());
}

/// Dropping the device with reads still queued discards them safely and joins the lanes.
#[test]
fn drop_with_queued_reads() {
    let dir = tmp_dir("drop");
    let (path, _) = random_file(&dir, "shard.bin", 2 * 1024 * 1024, 31);
    let arena = Arc::new(Arena::new(&[(64, vec![65_536])], 1).expect("arena"));
    let mut dev = open(std::slice::from_ref(&path), 2, true, &arena);
    for e in 0..64u16 {
        dev.submit(request(
            canonical(0, e),
            0,
            e,
            0,
            u64::from(e) * 4096,
            65_536,
            u32::from(e) % 2,
        ));
    }
    drop(dev);
    // The arena is still ours and usable.
    assert_eq!(Arc::strong_count(&arena), 1);
}

/// Requests the device cannot place fail through their completion, never by writing
/// elsewhere or panicking.
#[test]
fn bad_requests_fail_through_their_completion() {
    let dir = tmp_dir("bad");
    let (path, _) = random_file(&dir, "shard.bin", 100_000, 41);
    let arena = arena();
    let mut dev = open(std::slice::from_ref(&path), 2, true, &arena);
    let ok = request(canonical(0, 1), 0, 1, 0, 10, PROJ_LENS[0], 0);
    let cases: Vec<(ReadRequest, &str)> = vec![
        (ReadRequest { lane: 2, ..ok }, "lane"),
        (ReadRequest { shard: 1, ..ok }, "shard"),
        (
            ReadRequest {
                offset: 99_000,
                ..ok
            },
            "past end",
        ),
        (
            ReadRequest {
                len: 5_000_000,
                ..ok
            },
            "overruns slot",
        ),
        (
            ReadRequest {
                dest: canonical(0, 99),
                tag: tag(0, 99, 0),
                ..ok
            },
            "expert",
        ),
        (
            ReadRequest {
                dest: canonical(7, 1),
                tag: tag(7, 1, 0),
                ..ok
            },
            "layer",
        ),
        (
            ReadRequest {
                tag: tag(0, 1, 9),
                ..ok
            },
            "projection",
        ),
        (
            ReadRequest {
                dest: SlotId::Staging(9),
                ..ok
            },
            "staging",
        ),
        (
            ReadRequest {
                dest_offset: 11,
                ..ok
            },
            "dest_offset > offset",
        ),
        (ReadRequest { len: 0, ..ok }, "empty"),
    ];
    for (req, what) in cases {
        let id = dev.submit(req);
        match (what, dev.wait(id)) {
            (
                "lane",
                Err(FlashError::BadLane {
                    lane: 2, lanes: 2, ..
                }),
            ) => {}
            ("lane", other) => panic!("bad lane: {other:?}"),
            (_, Err(FlashError::Io { .. })) => {}
            (w, other) => panic!("{w}: expected an Io error, got {other:?}"),
        }
    }
    // The device is still healthy.
    let id = dev.submit(ok);
    assert!(dev.wait(id).is_ok());
}

/// EIO and short reads injected through `FaultyFlash<LaneFlash>` reach the caller as errors.
#[test]
fn faults_through_faulty_flash_are_errors() {
    let dir = tmp_dir("faulty");
    let (path, _) = random_file(&dir, "shard.bin", 200_000, 51);
    let arena = arena();
    for fault in [Fault::Eio, Fault::Short { got: 17 }] {
        let dev = open(std::slice::from_ref(&path), 2, true, &arena);
        let mut f = FaultyFlash::new(dev, 1, fault);
        let ids: Vec<_> = (0..3u16)
            .map(|e| {
                f.submit(request(
                    canonical(0, e),
                    0,
                    e,
                    0,
                    u64::from(e) * 1000,
                    PROJ_LENS[0],
                    0,
                ))
            })
            .collect();
        assert!(f.wait(ids[0]).is_ok());
        match (fault, f.wait(ids[1])) {
            (Fault::Eio, Err(FlashError::Io { .. })) => {}
            (
                Fault::Short { got },
                Err(FlashError::Short {
                    got: g, expected, ..
                }),
            ) => {
                assert_eq!((g, expected), (got, PROJ_LENS[0]));
            }
            (_, other) => panic!("{fault:?}: expected an error, got {other:?}"),
        }
        assert!(f.injected());
        assert!(f.wait(ids[2]).is_ok());
    }
}

/// A real short read: the file shrinks after open, so the extent is no longer all there.
#[test]
fn truncated_file_is_a_short_read() {
    let dir = tmp_dir("short");
    for direct in [true, false] {
        let (path, _) = random_file(&dir, &format!("shard-{direct}.bin"), 100_000, 61);
        let arena = arena();
        let mut dev = open(std::slice::from_ref(&path), 1, direct, &arena);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("reopen");
        file.set_len(50_000).expect("truncate");
        let id = dev.submit(request(canonical(0, 0), 0, 0, 0, 47_000, PROJ_LENS[0], 0));
        match dev.wait(id) {
            Err(FlashError::Short { expected, got, .. }) => {
                assert_eq!(expected, PROJ_LENS[0]);
                assert_eq!(got, 3_000, "direct {direct}");
            }
            other => panic!("direct {direct}: expected a short read, got {other:?}"),
        }
    }
}

/// On tmpfs the device serves the right bytes either way: kernels before 6.6 refuse O_DIRECT
/// there (then it falls back to buffered with a warning), newer ones accept it.
#[test]
fn tmpfs_falls_back_to_buffered() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("skipping: /dev/shm is absent");
        return;
    }
    let dir = shm.join(format!("bmoe-flash-test-{}", std::process::id()));
    if std::fs::create_dir_all(&dir).is_err() {
        eprintln!("skipping: cannot write to /dev/shm");
        return;
    }
    let (path, bytes) = random_file(&dir, "shard.bin", 300_000, 71);
    let (ok_path, _) = random_file(&tmp_dir("mixed"), "shard.bin", 300_000, 72);
    let arena = arena();
    let mut dev = open(&[ok_path.clone(), path.clone()], 2, true, &arena);
    use std::os::unix::fs::OpenOptionsExt;
    let refused = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .is_err();
    if refused {
        assert!(!dev.o_direct_achieved());
        assert_eq!(dev.warnings().len(), 1, "{:?}", dev.warnings());
        assert!(dev.warnings()[0].contains("shard 1"));
    }
    let mut req = request(canonical(0, 3), 0, 3, 1, 123_457, PROJ_LENS[1], 1);
    req.shard = 1;
    let id = dev.submit(req);
    let done = dev.wait(id).expect("buffered read succeeds");
    if refused {
        assert_eq!(done.read_bytes, PROJ_LENS[1]);
    }
    let got = projection(&arena, 0, req.dest, 1, req.offset, req.len);
    assert!(got == bytes[123_457..123_457 + PROJ_LENS[1] as usize]);
    drop(dev);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A file whose filesystem refuses O_DIRECT at open (procfs: EINVAL) falls back to
/// buffered with one warning naming the shard; the other shard keeps O_DIRECT and serves.
#[test]
fn refused_o_direct_falls_back_with_a_warning() {
    let proc_file = PathBuf::from("/proc/version");
    if !proc_file.exists() {
        eprintln!("skipping: /proc/version is absent");
        return;
    }
    let (ok_path, bytes) = random_file(&tmp_dir("refused"), "shard.bin", 300_000, 73);
    let arena = arena();
    let mut dev = open(&[ok_path, proc_file], 2, true, &arena);
    assert!(!dev.o_direct_achieved());
    assert_eq!(dev.warnings().len(), 1, "{:?}", dev.warnings());
    assert!(
        dev.warnings()[0].contains("shard 1"),
        "{}",
        dev.warnings()[0]
    );
    let req = request(canonical(0, 2), 0, 2, 0, 4097, PROJ_LENS[0], 1);
    let id = dev.submit(req);
    let done = dev.wait(id).expect("O_DIRECT shard still serves");
    assert_eq!(done.read_bytes % ALIGN, 0);
    let got = projection(&arena, 0, req.dest, 0, req.offset, req.len);
    assert!(got == bytes[4097..4097 + PROJ_LENS[0] as usize]);
    // Without O_DIRECT asked for, nothing is refused and nothing is warned about.
    let dev = open(&[PathBuf::from("/proc/version")], 1, false, &arena);
    assert!(dev.warnings().is_empty());
}

#[test]
fn open_errors_are_reported() {
    let arena = arena();
    let c = MonotonicClock::new();
    assert!(matches!(
        LaneFlash::open(&[], 1, true, arena.clone(), c),
        Err(FlashOpenError::NoShards)
    ));
    let dir = tmp_dir("open");
    let (path, _) = random_file(&dir, "shard.bin", 10_000, 81);
    for lanes in [0, 9] {
        assert!(matches!(
            LaneFlash::open(std::slice::from_ref(&path), lanes, true, arena.clone(), c),
            Err(FlashOpenError::BadLanes { .. })
        ));
    }
    assert!(matches!(
        LaneFlash::open(&[dir.join("missing.bin")], 1, true, arena.clone(), c),
        Err(FlashOpenError::Open { shard: 0, .. })
    ));
}

/// Raw pread bandwidth, the baseline for the streaming benchmark. Not a test of speed:
/// `cargo test -p bmoe-engine --release --test flash -- --ignored --nocapture raw_bench`.
/// Set `BMOE_BENCH_FILE` to a large file on the device of interest (ideally bigger than
/// RAM or freshly dropped from the page cache); otherwise a 256 MiB file under target/.
#[test]
#[ignore]
fn raw_bench() {
    let path = match std::env::var_os("BMOE_BENCH_FILE") {
        Some(p) => PathBuf::from(p),
        None => random_file(&tmp_dir("bench"), "big.bin", 256 << 20, 91).0,
    };
    for request in [64u64 << 10, 256 << 10, 1 << 20, 4 << 20] {
        for lanes in [1u32, 2, 4, 8] {
            let mibs = raw_read_bench(
                &path,
                request,
                lanes,
                RawIo {
                    o_direct: true,
                    huge_pages: true,
                },
                256 << 20,
                None,
            )
            .expect("bench");
            println!(
                "raw O_DIRECT: request {:>5} KiB, {lanes} lanes: {mibs:>8.1} MiB/s",
                request >> 10
            );
        }
    }
}
