//! Checkpoints in the daemon: the shell of `psls_ckpt`'s state machines.
//!
//! - `round`: [`CkptShell`], checkpoint rounds — the coordinator's side (begin, prepare,
//!   flush, commit record, decide; a memory round only prepares and decides) and every node's
//!   participant (take the dirty pages, write them to both copies, report);
//! - `memory`: the memory level — a participant's pages to their holders' recovery areas, a
//!   cleaner's flush of recovery copies, the recovery-area requests, a rollback's re-creation
//!   of lost copies;
//! - `batches`: how a participant's pages go to their two holders, batch by batch (both
//!   levels);
//! - `safepoint`: the ranks' collective safe-point call (`Session::checkpoint`) at the
//!   coordinator and on the ranks' nodes, operators' requests (`psls checkpoint`, `psls
//!   halt`), and the ranks' private states;
//! - `states`: the on-disk layout of the ranks' states in a job's checkpoint area, and the
//!   names of the area's files (the states, and one per volatile segment of the job);
//! - `writers`: one writer job per file (claims in the metadata), and which job a process is.

mod batches;
mod memory;
mod round;
mod safepoint;
mod states;
mod writers;

pub use crate::peer::SafeCall;
pub use round::{CkptShell, Done, MAX_CKPT_FILES};
pub use safepoint::restart_output_seq;
pub use states::{not_reserved, state_file_name, volatile_file_name, MAX_STATE_BYTES};
pub use writers::{drop_earlier_claims, ext_job, is_process_job};
