//! The process's allocator policy: glibc keeps freed memory for reuse instead of handing it back
//! to the kernel.
//!
//! A training step allocates and frees the same large buffers every step (activations, logits,
//! gradient buckets, a bf16 run's weight copies). Whatever glibc hands back to the kernel comes
//! back as fresh pages on the next step: a page fault per 4 KiB, zeroed by the kernel, each a VM
//! exit on a virtual machine. glibc hands memory back three ways, and the policy closes each:
//!
//! 1. A block at or above the mmap threshold (128 KiB at start, rising to at most 32 MiB) is its
//!    own `mmap`, unmapped on free. At qwen3-0.6b the logits (311 MB), the embedding's gradient
//!    (622 MB) and its bf16 copy are far above any threshold glibc accepts: `M_MMAP_MAX` = 0
//!    serves every block from a heap.
//! 2. A thread's arena is made of 64 MiB heaps, which cannot hold a larger block (glibc then maps
//!    it anyway) and are unmapped when left empty: `M_ARENA_MAX` = 1 puts every thread on the
//!    main arena, one `brk` heap of any size. Device threads allocate a few hundred blocks per
//!    micro-batch, so the shared lock is not contended.
//! 3. The main heap's free top is trimmed past the trim threshold: `M_TRIM_THRESHOLD` = -1 (the
//!    largest `size_t`) never trims.
//!
//! Peak RSS is then the heap's high-water mark, which the same step's blocks keep reusing.
//! Measured on qwen3-0.6b (`ferrotext train model_name=qwen3-0.6b ici_data_parallelism=1
//! local_devices=1 per_device_batch_size=2 max_target_length=256 gradient_accumulation_steps=2
//! opt_type=adamw steps=4 dtype=bfloat16`, this 2-core VM), against `FERROTEXT_MALLOC=default`
//! (glibc's defaults, for measuring the difference): system time a step 7.93 → 1.23 s (21.5% →
//! 4.0% of the step's CPU time), page faults over the run 10.6 M → 3.6 M (what is left is
//! start-up's first touch of the weights and the optimizer state), peak RSS 14.15 → 13.91 GB.
//!
//! The heap is also backed by transparent huge pages where the kernel gives them only on request
//! (`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise`, the common default): glibc's
//! tunable `glibc.malloc.hugetlb=1` advises every extension of the heap. The products' packing
//! walks weights and activations in strided passes that touch a new 4 KiB page every few rows;
//! on 2 MiB pages a qwen3-peer step (512 tokens a micro-batch, GA 4) went from 177–187 to
//! 158–166 ms in bf16 and from 270–280 to 253–259 ms in f32 (two alternated runs each), a
//! qwen3-0.6b bf16 step (2 × 256 tokens, GA 2) from 8.2–8.9 to 7.5 s. glibc
//! reads tunables only when a process starts, so [`huge_pages_or_reexec`] starts the program
//! again with the tunable added to `GLIBC_TUNABLES`.

/// The environment variable that, set to `default`, leaves glibc's allocator as it is.
const OPT_OUT_VAR: &str = "FERROTEXT_MALLOC";

/// glibc's tunables, read once at process start (`name=value` pairs joined by `:`).
const TUNABLES_VAR: &str = "GLIBC_TUNABLES";

/// The tunable that makes glibc advise its heap for transparent huge pages (glibc 2.35 and
/// later; older versions ignore a tunable they do not know).
const HUGE_PAGES_TUNABLE: &str = "glibc.malloc.hugetlb";

/// The kernel's transparent huge page mode, `always [madvise] never` with the mode bracketed.
const THP_MODE_PATH: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// `GLIBC_TUNABLES` with huge pages asked for, or `None` where asking changes nothing or is the
/// user's call: the kernel gives huge pages without advice (`always`) or not at all (`never`,
/// or no such file), or `GLIBC_TUNABLES` already sets `glibc.malloc.hugetlb` (`=0` is how a user
/// turns it off). Other tunables the user set are kept, the new one appended.
fn tunables_with_huge_pages(tunables: Option<&str>, thp_mode: Option<&str>) -> Option<String> {
    if !thp_mode.is_some_and(|m| m.contains("[madvise]")) {
        return None;
    }
    let asked = format!("{HUGE_PAGES_TUNABLE}=1");
    match tunables.filter(|t| !t.is_empty()) {
        None => Some(asked),
        Some(t)
            if t.split(':')
                .any(|kv| kv.split('=').next() == Some(HUGE_PAGES_TUNABLE)) =>
        {
            None
        }
        Some(t) => Some(format!("{t}:{asked}")),
    }
}

/// Starts this program again, with the same arguments and pid, with glibc's heap on transparent
/// huge pages (see the module docs), unless that changes nothing ([`tunables_with_huge_pages`])
/// or `FERROTEXT_MALLOC=default`. Returns only when it does not re-execute, or when the
/// re-execution fails (the program then goes on with 4 KiB pages). Call first thing in `main`.
pub fn huge_pages_or_reexec() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt;
        if std::env::var_os(OPT_OUT_VAR).is_some_and(|v| v == "default") {
            return;
        }
        let tunables = std::env::var(TUNABLES_VAR).ok();
        let mode = std::fs::read_to_string(THP_MODE_PATH).ok();
        let Some(tunables) = tunables_with_huge_pages(tunables.as_deref(), mode.as_deref()) else {
            return;
        };
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let mut args = std::env::args_os();
        let mut command = std::process::Command::new(exe);
        if let Some(arg0) = args.next() {
            command.arg0(arg0);
        }
        // `exec` returns only on failure; the program then runs as it is.
        let _failed = command.args(args).env(TUNABLES_VAR, tunables).exec();
    }
}

/// Sets the policy (see the module docs) unless `FERROTEXT_MALLOC=default`. Call first thing in
/// `main`, before any thread starts; returns whether glibc took every setting (other C libraries
/// do not have `mallopt`'s parameters and are left as they are).
pub fn keep_freed_memory() -> bool {
    if std::env::var_os(OPT_OUT_VAR).is_some_and(|v| v == "default") {
        return false;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only sets allocator tunables; it is called before any other thread
        // exists, as glibc requires for changing them. -1 for the trim threshold is glibc's
        // documented "never trim" (the value is taken as a `size_t`).
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1) == 1
                && libc::mallopt(libc::M_MMAP_MAX, 0) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, -1) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::tunables_with_huge_pages;

    const MADVISE: Option<&str> = Some("always [madvise] never\n");

    #[test]
    fn huge_pages_are_asked_for_only_where_the_kernel_waits_for_advice() {
        assert_eq!(
            tunables_with_huge_pages(None, MADVISE).as_deref(),
            Some("glibc.malloc.hugetlb=1")
        );
        assert_eq!(
            tunables_with_huge_pages(Some(""), MADVISE).as_deref(),
            Some("glibc.malloc.hugetlb=1")
        );
        for mode in [
            Some("[always] madvise never"),
            Some("always madvise [never]"),
            None,
        ] {
            assert_eq!(tunables_with_huge_pages(None, mode), None, "{mode:?}");
        }
    }

    #[test]
    fn a_users_tunables_are_kept_and_their_own_huge_page_choice_wins() {
        assert_eq!(
            tunables_with_huge_pages(Some("glibc.malloc.tcache_count=0"), MADVISE).as_deref(),
            Some("glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1")
        );
        for set in [
            "glibc.malloc.hugetlb=0",
            "glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1",
        ] {
            assert_eq!(tunables_with_huge_pages(Some(set), MADVISE), None, "{set}");
        }
        // A tunable whose name only starts with the same words is another tunable.
        assert_eq!(
            tunables_with_huge_pages(Some("glibc.malloc.hugetlbx=1"), MADVISE).as_deref(),
            Some("glibc.malloc.hugetlbx=1:glibc.malloc.hugetlb=1")
        );
    }
}
