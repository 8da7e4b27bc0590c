//! The ggml tensor types a GGUF file can hold, with their block geometry.
//!
//! Every type's block size and bytes per block is known here, even for types we have no
//! kernel for, so that any file can be understood, sized and bounds-checked, and an
//! unsupported type is reported by name instead of misread.

use std::fmt;

/// A ggml tensor element type, numbered as in the GGUF format (`ggml_type`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

/// (type, ggml id, name, elements per block, bytes per block), as ggml's `type_traits`
/// (block size, `sizeof(block_*)`). Q8_1 is 36 bytes (f16 d and s, 32 i8); gguf-py still
/// says 40, but Q8_1 only ever exists as an activation format, never in a file.
const TABLE: &[(GgmlType, u32, &str, u64, u64)] = &[
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 36),
    (GgmlType::Q2_K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3_K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4_K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5_K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6_K, 14, "Q6_K", 256, 210),
    (GgmlType::Q8_K, 15, "Q8_K", 256, 292),
    (GgmlType::IQ2_XXS, 16, "IQ2_XXS", 256, 66),
    (GgmlType::IQ2_XS, 17, "IQ2_XS", 256, 74),
    (GgmlType::IQ3_XXS, 18, "IQ3_XXS", 256, 98),
    (GgmlType::IQ1_S, 19, "IQ1_S", 256, 50),
    (GgmlType::IQ4_NL, 20, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, 21, "IQ3_S", 256, 110),
    (GgmlType::IQ2_S, 22, "IQ2_S", 256, 82),
    (GgmlType::IQ4_XS, 23, "IQ4_XS", 256, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::IQ1_M, 29, "IQ1_M", 256, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::TQ1_0, 34, "TQ1_0", 256, 54),
    (GgmlType::TQ2_0, 35, "TQ2_0", 256, 66),
    (GgmlType::MXFP4, 39, "MXFP4", 32, 17),
    (GgmlType::NVFP4, 40, "NVFP4", 64, 36),
    (GgmlType::Q1_0, 41, "Q1_0", 128, 18),
];

impl GgmlType {
    /// This type's row of [`TABLE`]. A `const fn` (a loop, not an iterator) so that block
    /// geometry is known at compile time: the kernels assert their block structs' sizes
    /// against it.
    const fn row(self) -> &'static (GgmlType, u32, &'static str, u64, u64) {
        let mut i = 0;
        while i < TABLE.len() {
            if TABLE[i].0 as u32 == self as u32 {
                return &TABLE[i];
            }
            i += 1;
        }
        // The table is complete for every variant (a test checks it); never reached.
        &TABLE[0]
    }

    /// The type for a ggml id, or `None` for an id this build does not know.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TABLE.iter().find(|r| r.1 == id).map(|r| r.0)
    }

    /// The type for its ggml name (`"Q4_K"`, case-insensitive).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        TABLE
            .iter()
            .find(|r| r.2.eq_ignore_ascii_case(name))
            .map(|r| r.0)
    }

    /// The ggml id stored in a GGUF tensor info.
    pub fn id(self) -> u32 {
        self.row().1
    }

    /// The ggml name, as llama.cpp prints it.
    pub fn name(self) -> &'static str {
        self.row().2
    }

    /// Elements per block (1 for plain types).
    pub const fn block_size(self) -> u64 {
        self.row().3
    }

    /// Bytes per block.
    pub const fn type_size(self) -> u64 {
        self.row().4
    }

    /// Bytes of one row of `n` elements, or `None` when `n` is not a whole number of blocks
    /// or the size overflows.
    #[allow(clippy::manual_is_multiple_of)] // is_multiple_of needs Rust 1.87; we support 1.85
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        if n % self.block_size() != 0 {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }

    /// Bytes of `n` elements laid out as rows of `row_len` (the tensor's `dims[0]`), or
    /// `None` when `row_len` is not a whole number of blocks, `n` not a whole number of rows,
    /// or the size overflows.
    #[allow(clippy::manual_is_multiple_of)] // is_multiple_of needs Rust 1.87; we support 1.85
    pub fn bytes_for(self, row_len: u64, n: u64) -> Option<u64> {
        if row_len == 0 || n % row_len != 0 {
            return None;
        }
        self.row_bytes(row_len)?.checked_mul(n / row_len)
    }

    /// Every known type.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|r| r.0)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names_round_trip() {
        for t in GgmlType::all() {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), None);
    }

    /// Every variant has its own row (`row` falls back to the first row otherwise): the match
    /// is exhaustive, so a new variant without a row fails to compile here or fails this test.
    #[test]
    fn every_variant_has_a_row() {
        use GgmlType::*;
        let check = |t: GgmlType| match t {
            F32 | F16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | Q2_K | Q3_K | Q4_K | Q5_K
            | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S | IQ4_NL | IQ3_S | IQ2_S
            | IQ4_XS | I8 | I16 | I32 | I64 | F64 | IQ1_M | BF16 | TQ1_0 | TQ2_0 | MXFP4
            | NVFP4 | Q1_0 => assert_eq!(t.row().0, t, "{t:?}"),
        };
        for t in [
            F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
            IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, I8, I16, I32, I64, F64,
            IQ1_M, BF16, TQ1_0, TQ2_0, MXFP4, NVFP4, Q1_0,
        ] {
            check(t);
        }
        assert_eq!(GgmlType::all().count(), 34);
    }

    #[test]
    fn row_bytes_follow_block_geometry() {
        assert_eq!(GgmlType::Q4_K.row_bytes(2048), Some(8 * 144));
        assert_eq!(GgmlType::Q8_0.row_bytes(256), Some(8 * 34));
        assert_eq!(GgmlType::Q8_0.row_bytes(100), None);
        assert_eq!(GgmlType::F32.row_bytes(3), Some(12));
        assert_eq!(GgmlType::Q4_K.bytes_for(256, 512), Some(288));
        assert_eq!(GgmlType::Q4_K.bytes_for(256, 300), None);
        assert_eq!(GgmlType::Q4_K.bytes_for(0, 0), None);
    }

    /// Block geometry of every type the issue names, from ggml's `type_traits`.
    #[test]
    fn named_types_have_ggml_geometry() {
        let expected: &[(&str, u64, u64)] = &[
            ("F32", 1, 4),
            ("F16", 1, 2),
            ("BF16", 1, 2),
            ("Q8_0", 32, 34),
            ("Q4_0", 32, 18),
            ("Q4_1", 32, 20),
            ("Q5_0", 32, 22),
            ("Q5_1", 32, 24),
            ("Q2_K", 256, 84),
            ("Q3_K", 256, 110),
            ("Q4_K", 256, 144),
            ("Q5_K", 256, 176),
            ("Q6_K", 256, 210),
            ("Q8_K", 256, 292),
            ("MXFP4", 32, 17),
        ];
        for &(name, block, size) in expected {
            let t = GgmlType::from_name(name).expect(name);
            assert_eq!((t.block_size(), t.type_size()), (block, size), "{name}");
        }
    }
}
