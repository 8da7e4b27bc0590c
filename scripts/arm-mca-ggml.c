// One ggml-cpu kernel call between two marker functions, for scripts/arm-mca.py (which builds
// this against llama.cpp's own ARM objects: arch/arm/quants.c, arch/arm/repack.cpp, vec.cpp,
// compiled with aarch64-linux-gnu-gcc -O3 -march=armv8.2-a+dotprod+i8mm) so that ggml's kernels
// are priced exactly as ours are (engine/examples/kernel_trace.rs): the instructions executed
// after bmoe_trace_begin returns and before bmoe_trace_end is entered, for two row lengths.
//
//   ggml_trace KIND FUNCTION N256 ROWS TOKENS WEIGHT_BYTES_256 ACT_BYTES_256
//
// KIND says how FUNCTION is called (ggml's own signatures):
//   vec_dot   FUNCTION(n, s, 0, row, 0, act, 0, 1)             one row, one token (ROWS = TOKENS = 1)
//   vec_dot2  FUNCTION(n, s, 2, rows, rb, acts, ab, 2)         the i8mm path: 2 rows x 2 tokens
//   gemv      FUNCTION(n, s, ROWS, rows, act, 1, ROWS)          repacked rows, one token
//   gemm      FUNCTION(n, s, ROWS, rows, acts, TOKENS, ROWS)    repacked rows, TOKENS (4) tokens
// n = N256 * 256 values per row. The buffers hold random bytes (ROWS rows of N256 *
// WEIGHT_BYTES_256 bytes, TOKENS activations of N256 * ACT_BYTES_256 bytes; a repacked layout has
// the same bytes as the plain rows it interleaves): ggml's NEON kernels take no branch on the
// values, so the executed instructions do not depend on them. The call runs once before the
// traced one, as ours does.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void (*vec_dot_fn)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
typedef void (*gem_fn)(int, float *, size_t, const void *, const void *, int, int);

#define VEC_DOTS(X)                                                                               \
    X(ggml_vec_dot_f32) X(ggml_vec_dot_f16) X(ggml_vec_dot_bf16) X(ggml_vec_dot_q8_0_q8_0)        \
    X(ggml_vec_dot_q4_0_q8_0) X(ggml_vec_dot_q4_1_q8_1) X(ggml_vec_dot_q5_0_q8_0)                 \
    X(ggml_vec_dot_q5_1_q8_1) X(ggml_vec_dot_q2_K_q8_K) X(ggml_vec_dot_q3_K_q8_K)                 \
    X(ggml_vec_dot_q4_K_q8_K) X(ggml_vec_dot_q5_K_q8_K) X(ggml_vec_dot_q6_K_q8_K)                 \
    X(ggml_vec_dot_iq4_nl_q8_0) X(ggml_vec_dot_iq4_xs_q8_K) X(ggml_vec_dot_mxfp4_q8_0)
#define GEMS(X)                                                                                   \
    X(q8_0_4x8_q8_0) X(q8_0_4x4_q8_0) X(q4_0_4x8_q8_0) X(q4_0_4x4_q8_0) X(q4_K_8x8_q8_K)          \
    X(q4_K_8x4_q8_K) X(q5_K_8x8_q8_K) X(q5_K_8x4_q8_K) X(q6_K_8x8_q8_K) X(q6_K_8x4_q8_K)          \
    X(iq4_nl_4x4_q8_0) X(mxfp4_4x4_q8_0)

#define DECLARE_VEC_DOT(f) void f(int, float *, size_t, const void *, size_t, const void *, size_t, int);
#define DECLARE_GEM(t)                                                                            \
    void ggml_gemv_##t(int, float *, size_t, const void *, const void *, int, int);              \
    void ggml_gemm_##t(int, float *, size_t, const void *, const void *, int, int);
VEC_DOTS(DECLARE_VEC_DOT)
GEMS(DECLARE_GEM)

struct named {
    const char *name;
    void *fn;
};
#define NAME_VEC_DOT(f) {#f, (void *)f},
#define NAME_GEM(t) {"ggml_gemv_" #t, (void *)ggml_gemv_##t}, {"ggml_gemm_" #t, (void *)ggml_gemm_##t},
static const struct named FUNCTIONS[] = {VEC_DOTS(NAME_VEC_DOT) GEMS(NAME_GEM)};

__attribute__((noinline)) void bmoe_trace_begin(void) { __asm__ volatile("nop"); }
__attribute__((noinline)) void bmoe_trace_end(void) { __asm__ volatile("nop\n\tnop"); }

static void fail(const char *msg, const char *what) {
    fprintf(stderr, "ggml_trace: %s%s\n", msg, what);
    exit(2);
}

static long count(const char *s) {
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || v <= 0) fail("not a positive count: ", s);
    return v;
}

static void *random_bytes(size_t n, uint64_t seed) {
    // Slack past the end: some kernels load a vector past their last block's bytes.
    uint8_t *p = malloc(n + 4096);
    if (!p) fail("out of memory", "");
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n + 4096; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        p[i] = (uint8_t)(s >> 24);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc != 8)
        fail("usage: ggml_trace vec_dot|vec_dot2|gemv|gemm FUNCTION N256 ROWS TOKENS "
             "WEIGHT_BYTES_256 ACT_BYTES_256",
             "");
    const char *kind = argv[1];
    void *fn = NULL;
    for (size_t i = 0; i < sizeof FUNCTIONS / sizeof FUNCTIONS[0]; i++)
        if (!strcmp(FUNCTIONS[i].name, argv[2])) fn = FUNCTIONS[i].fn;
    if (!fn) fail("unknown function ", argv[2]);
    long n256 = count(argv[3]), rows = count(argv[4]), tokens = count(argv[5]);
    size_t row_bytes = (size_t)(n256 * count(argv[6])), act_bytes = (size_t)(n256 * count(argv[7]));
    int n = (int)(n256 * 256);
    void *w = random_bytes(rows * row_bytes, 1), *a = random_bytes(tokens * act_bytes, 2);
    float *s = calloc((size_t)(rows * tokens) + 16, sizeof(float));
    if (!s) fail("out of memory", "");

    // The kind is decided before the traced call, so that only the call is between the markers.
    const char *kinds[] = {"vec_dot", "vec_dot2", "gemv", "gemm"};
    int k = -1;
    for (int i = 0; i < 4; i++)
        if (!strcmp(kind, kinds[i])) k = i;
    if (k < 0) fail("unknown kind ", kind);
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) bmoe_trace_begin();
        switch (k) {
        case 0: ((vec_dot_fn)fn)(n, s, 0, w, 0, a, 0, 1); break;
        case 1: ((vec_dot_fn)fn)(n, s, 2, w, row_bytes, a, act_bytes, 2); break;
        case 2: ((gem_fn)fn)(n, s, (size_t)rows, w, a, 1, (int)rows); break;
        default: ((gem_fn)fn)(n, s, (size_t)rows, w, a, (int)tokens, (int)rows); break;
        }
        if (pass == 1) bmoe_trace_end();
    }
    double sum = 0;
    for (long i = 0; i < rows * tokens; i++) sum += s[i];
    printf("%s %s n=%d rows=%ld tokens=%ld sum=%g\n", kind, argv[2], n, rows, tokens, sum);
    return 0;
}
