//! On-disk slot header, format version 1. All integers little-endian.
//!
//! ```text
//! offset size field
//!      0    4 magic  b"PSPG"
//!      4    2 format version (1)
//!      6    2 flags (0)
//!      8    8 file id
//!     16    8 page index in the file
//!     24    8 generation (commit number of the version held)
//!     32   28 reserved, zero
//!     60    4 crc32 over header bytes 0..60 followed by the 4096 data bytes
//! ```
//! A slot whose header is all zero has never been written.

use psls_svm::{FileId, PAGE_SIZE};

pub const HEADER_LEN: usize = 64;
pub const MAGIC: [u8; 4] = *b"PSPG";
pub const FORMAT_VERSION: u16 = 1;

/// What a header says before its checksum is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderState {
    /// All zero: never written.
    Empty,
    /// Parses and names the expected page.
    Written { gen: u64, crc: u32 },
    /// A header of a later format (a newer build wrote it): neither read nor written over.
    Newer { version: u16 },
    /// Anything else: torn, foreign or garbage.
    Garbage,
}

/// Encodes a header for `data`.
pub fn encode(file: FileId, index: u64, gen: u64, data: &[u8]) -> [u8; HEADER_LEN] {
    debug_assert_eq!(data.len(), PAGE_SIZE);
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[8..16].copy_from_slice(&file.0.to_le_bytes());
    h[16..24].copy_from_slice(&index.to_le_bytes());
    h[24..32].copy_from_slice(&gen.to_le_bytes());
    let crc = checksum(&h, data);
    h[60..64].copy_from_slice(&crc.to_le_bytes());
    h
}

/// crc32 of header bytes 0..60 and the data.
pub fn checksum(header: &[u8; HEADER_LEN], data: &[u8]) -> u32 {
    let mut c = crc32fast::Hasher::new();
    c.update(&header[0..60]);
    c.update(data);
    c.finalize()
}

/// Parses a header that should describe page `index` of `file`.
pub fn parse(h: &[u8; HEADER_LEN], file: FileId, index: u64) -> HeaderState {
    if h.iter().all(|&b| b == 0) {
        return HeaderState::Empty;
    }
    let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().expect("8 bytes"));
    let version = u16::from_le_bytes([h[4], h[5]]);
    if h[0..4] == MAGIC && version > FORMAT_VERSION {
        return HeaderState::Newer { version };
    }
    let ok = h[0..4] == MAGIC && version == FORMAT_VERSION && u64_at(8) == file.0 && u64_at(16) == index;
    if !ok {
        return HeaderState::Garbage;
    }
    HeaderState::Written {
        gen: u64_at(24),
        crc: u32::from_le_bytes(h[60..64].try_into().expect("4 bytes")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_fixed() {
        let data = vec![0xAB; PAGE_SIZE];
        let h = encode(FileId(0x0102030405060708), 9, 3, &data);
        assert_eq!(&h[0..4], b"PSPG");
        assert_eq!(&h[4..6], &[1, 0]);
        assert_eq!(&h[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(h[16], 9);
        assert_eq!(h[24], 3);
        assert!(h[32..60].iter().all(|&b| b == 0));
        match parse(&h, FileId(0x0102030405060708), 9) {
            HeaderState::Written { gen: 3, crc } => assert_eq!(crc, checksum(&h, &data)),
            other => panic!("{other:?}"),
        }
        assert_eq!(parse(&h, FileId(1), 9), HeaderState::Garbage);
        assert_eq!(parse(&h, FileId(0x0102030405060708), 8), HeaderState::Garbage);
        assert_eq!(parse(&[0u8; HEADER_LEN], FileId(1), 1), HeaderState::Empty);
        let mut later = h;
        later[4] = 2;
        assert_eq!(
            parse(&later, FileId(0x0102030405060708), 9),
            HeaderState::Newer { version: 2 }
        );
    }
}
