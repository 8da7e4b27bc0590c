#![no_main]
//! libFuzzer harness: the body is `bmoe_engine::fuzzing::Target::IoTrace`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    bmoe_engine::fuzzing::Target::IoTrace.run(data);
});
