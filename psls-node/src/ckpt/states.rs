//! The ranks' private states in a job's checkpoint area: one parallel file per job
//! ([`state_file_name`]), a slot of [`SLOT_PAGES`] pages per rank. A slot's first page is a
//! header, format version 2 (version 1, without the output number, is still read),
//! little-endian:
//!
//! ```text
//! offset size field
//!      0    4 magic b"PSRS"
//!      4    2 format version (2)
//!      6    2 zero
//!      8    4 rank
//!     12    4 zero
//!     16    8 checkpoint epoch the state belongs to
//!     24    8 state length in bytes (≤ MAX_STATE_BYTES)
//!     32    4 crc32 of the state bytes
//!     36    4 zero
//!     40    8 the rank's last output line number at its safe point (version 2; all ones:
//!               not known)
//!     48 4048 zero
//! ```
//! A restart numbers the rank's output on from that line number, so a follower drops the lines
//! the rolled-back rank prints again.
//! and the state's bytes follow in the slot's next pages. Only the pages a state needs are
//! ever written; the others are never stored. Pages are written by the rank's node in the
//! checkpoint's round, like any dirty page, so a state is durable exactly when its
//! checkpoint commits.

use psls_svm::PAGE_SIZE;

/// The largest state one rank may save.
pub const MAX_STATE_BYTES: usize = psls_ipc::proto::MAX_CKPT_STATE;

/// Pages per rank slot: the header and room for the largest state.
pub const SLOT_PAGES: u64 = 1 + (MAX_STATE_BYTES / PAGE_SIZE) as u64;

const MAGIC: [u8; 4] = *b"PSRS";
const VERSION: u16 = 2;

/// What the names of checkpoint areas' files start with: reserved for the daemon (a user
/// cannot create, import, map or remove such a file, so nobody can plant one for a job).
pub const AREA_PREFIX: &str = ".psls-ckpt.";

/// Refuses a user's create, import, map or remove of a name in a checkpoint area.
pub fn not_reserved(name: &str) -> Result<(), crate::op::OpError> {
    if name.starts_with(AREA_PREFIX) {
        return Err(crate::op::OpError::new(
            psls_ipc::ErrorKind::Permission,
            format!("names starting with '{AREA_PREFIX}' are reserved for jobs' checkpoint areas"),
        ));
    }
    Ok(())
}

/// The name of `job`'s checkpoint area file.
pub fn state_file_name(job: &str) -> String {
    format!("{AREA_PREFIX}{job}")
}

/// The name of the file in `job`'s checkpoint area that keeps its volatile segment `name`.
pub fn volatile_file_name(job: &str, name: &str) -> String {
    format!("{}{name}", volatile_prefix(job))
}

/// What the names of `job`'s volatile segments' files start with.
pub fn volatile_prefix(job: &str) -> String {
    format!("{AREA_PREFIX}{job}.v.")
}

/// Its size for a job of `size` ranks.
pub fn state_file_size(size: u32) -> u64 {
    size as u64 * SLOT_PAGES * PAGE_SIZE as u64
}

/// A slot's header, as [`header`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The checkpoint the state belongs to.
    pub epoch: u64,
    /// The state's length in bytes.
    pub len: usize,
    /// The rank's last output line number at its safe point (`None`: a version 1 slot).
    pub output_seq: Option<u64>,
}

/// The pages of rank `rank`'s `state` taken at `epoch`, with its last output line number
/// `output_seq`: the first page index and the bytes (whole pages).
pub fn encode(rank: u32, epoch: u64, state: &[u8], output_seq: Option<u64>) -> (u64, Vec<u8>) {
    debug_assert!(state.len() <= MAX_STATE_BYTES);
    let pages = 1 + state.len().div_ceil(PAGE_SIZE);
    let mut out = vec![0u8; pages * PAGE_SIZE];
    out[0..4].copy_from_slice(&MAGIC);
    out[4..6].copy_from_slice(&VERSION.to_le_bytes());
    out[8..12].copy_from_slice(&rank.to_le_bytes());
    out[16..24].copy_from_slice(&epoch.to_le_bytes());
    out[24..32].copy_from_slice(&(state.len() as u64).to_le_bytes());
    out[32..36].copy_from_slice(&crc32fast::hash(state).to_le_bytes());
    out[40..48].copy_from_slice(&output_seq.unwrap_or(u64::MAX).to_le_bytes());
    out[PAGE_SIZE..PAGE_SIZE + state.len()].copy_from_slice(state);
    (rank as u64 * SLOT_PAGES, out)
}

/// What a slot's header says.
pub fn header(rank: u32, page: &[u8]) -> Result<Header, String> {
    let le64 = |o: usize| u64::from_le_bytes(page[o..o + 8].try_into().unwrap_or([0; 8]));
    if page.len() != PAGE_SIZE || page[0..4] != MAGIC {
        return Err(format!("rank {rank}'s state slot has no header (no state was saved)"));
    }
    let version = u16::from_le_bytes([page[4], page[5]]);
    if version != 1 && version != VERSION {
        return Err(format!("rank {rank}'s state has an unknown format version {version}"));
    }
    if u32::from_le_bytes(page[8..12].try_into().unwrap_or([0; 4])) != rank {
        return Err(format!("rank {rank}'s state slot holds another rank's state"));
    }
    let len = le64(24) as usize;
    if len > MAX_STATE_BYTES {
        return Err(format!("rank {rank}'s state is {len} bytes: corrupt"));
    }
    Ok(Header {
        epoch: le64(16),
        len,
        output_seq: Some(le64(40)).filter(|s| version >= 2 && *s != u64::MAX),
    })
}

/// Checks the state bytes read after the header.
pub fn check(rank: u32, header_page: &[u8], state: &[u8]) -> Result<(), String> {
    let crc = u32::from_le_bytes(header_page[32..36].try_into().unwrap_or([0; 4]));
    if crc32fast::hash(state) != crc {
        return Err(format!("rank {rank}'s state fails its checksum"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_round_trips_and_its_header_is_fixed() {
        let state: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let (first, pages) = encode(3, 7, &state, Some(41));
        assert_eq!(first, 3 * SLOT_PAGES);
        assert_eq!(pages.len(), 3 * PAGE_SIZE);
        assert_eq!(&pages[0..6], b"PSRS\x02\x00");
        let h = header(3, &pages[..PAGE_SIZE]).unwrap();
        assert_eq!(
            h,
            Header {
                epoch: 7,
                len: 5000,
                output_seq: Some(41)
            }
        );
        let len = h.len;
        let body = &pages[PAGE_SIZE..PAGE_SIZE + len];
        check(3, &pages[..PAGE_SIZE], body).unwrap();
        let mut bad = body.to_vec();
        bad[10] ^= 1;
        assert!(check(3, &pages[..PAGE_SIZE], &bad).is_err());
        assert!(header(2, &pages[..PAGE_SIZE]).unwrap_err().contains("another rank"));
        assert!(header(3, &[0u8; PAGE_SIZE]).unwrap_err().contains("no header"));
        let (_, empty) = encode(0, 1, &[], None);
        assert_eq!(empty.len(), PAGE_SIZE);
        assert_eq!(header(0, &empty).unwrap().output_seq, None);
        // A version 1 slot (before the output number) reads with none.
        let mut v1 = pages[..PAGE_SIZE].to_vec();
        v1[4] = 1;
        v1[40..48].fill(0);
        assert_eq!(header(3, &v1).unwrap().output_seq, None);
        v1[4] = 3;
        assert!(header(3, &v1).unwrap_err().contains("unknown format version 3"));
        assert_eq!(SLOT_PAGES, 257);
    }
}
