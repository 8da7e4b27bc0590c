//! GGUF metadata values: the thirteen value types, arrays nested to any depth.

use std::fmt;

/// The type tag of a metadata value, numbered as in the GGUF format.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The type for its GGUF id, or `None` for an unknown id.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Smallest encoded size of one value of this type, used to bound array counts
    /// against the bytes left in the file before anything is allocated.
    pub fn min_encoded_bytes(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            String => 8,
            Array => 12,
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Element type and elements; every element has that type.
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            Value::U8(v) => Some(v as i64),
            Value::U16(v) => Some(v as i64),
            Value::U32(v) => Some(v as i64),
            Value::U64(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is any number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, v) => Some(v),
            _ => None,
        }
    }

    /// A string array as `&str`s, or `None` if this is not an array of strings.
    pub fn as_str_array(&self) -> Option<Vec<&str>> {
        self.as_array()?.iter().map(|v| v.as_str()).collect()
    }

    /// Append the value's GGUF encoding, without its own type tag: scalars little-endian,
    /// a string as u64 length + UTF-8 bytes, an array as element type (u32) + length (u64)
    /// + the elements. Used by the writer, and to hash a value exactly as it is stored.
    pub fn encode_into(&self, buf: &mut Vec<u8>) {
        match self {
            Value::U8(x) => buf.push(*x),
            Value::I8(x) => buf.extend_from_slice(&x.to_le_bytes()),
            Value::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
            Value::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
            Value::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
            Value::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
            Value::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
            Value::Bool(x) => buf.push(u8::from(*x)),
            Value::String(s) => Self::encode_str(buf, s),
            Value::Array(t, items) => {
                buf.extend_from_slice(&(*t as u32).to_le_bytes());
                buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for it in items {
                    it.encode_into(buf);
                }
            }
            Value::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
            Value::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
            Value::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        }
    }

    /// A GGUF string: u64 length, then the bytes.
    pub(crate) fn encode_str(buf: &mut Vec<u8>, s: &str) {
        buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
        buf.extend_from_slice(s.as_bytes());
    }

    /// Equality that compares floats by their bits, so NaN equals the same NaN (what a
    /// byte-exact round trip promises).
    pub fn bits_eq(&self, other: &Value) -> bool {
        match (self, other) {
            (Value::F32(a), Value::F32(b)) => a.to_bits() == b.to_bits(),
            (Value::F64(a), Value::F64(b)) => a.to_bits() == b.to_bits(),
            (Value::Array(ta, a), Value::Array(tb, b)) => {
                ta == tb && a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.bits_eq(y))
            }
            _ => self == other,
        }
    }

    /// Build a string array.
    pub fn strings<S: AsRef<str>>(items: impl IntoIterator<Item = S>) -> Value {
        Value::Array(
            ValueType::String,
            items
                .into_iter()
                .map(|s| Value::String(s.as_ref().to_string()))
                .collect(),
        )
    }
}

impl fmt::Display for Value {
    /// Short human form: long arrays are summarised, long strings cut.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::String(s) => {
                if s.chars().count() > 60 {
                    let cut: String = s.chars().take(57).collect();
                    write!(f, "{:?}...", cut)
                } else {
                    write!(f, "{:?}", s)
                }
            }
            Value::Array(t, v) => {
                if v.len() <= 8 {
                    write!(f, "[")?;
                    for (i, x) in v.iter().enumerate() {
                        if i > 0 {
                            write!(f, ", ")?;
                        }
                        write!(f, "{x}")?;
                    }
                    write!(f, "]")
                } else {
                    write!(f, "[{:?} x {}]", t, v.len())
                }
            }
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
        }
    }
}
