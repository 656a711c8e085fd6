//! The process's allocator policy: glibc keeps freed memory for reuse instead of handing it back
//! to the kernel.
//!
//! A training step allocates and frees the same large buffers every step (activations, gradient
//! buckets, the reduced gradients). By default glibc serves a block above its mmap threshold
//! (128 KiB at start, rising to at most 32 MiB as blocks are freed) with its own `mmap` and
//! unmaps it on free, and trims the heap's free top past 128 KiB, so the next step's buffers are
//! fresh pages again: a page fault per 4 KiB, each a VM exit on a virtual machine. Measured on
//! qwen3-peer (`ferrotext train model_name=qwen3-peer`, this 2-core VM, alternated runs): GA 1 at
//! data=4 201–205 → 182–184 ms a step, GA 4 at data=1 325–336 → 259–297 ms; peak RSS unchanged
//! (434 MB, 119 MB), since the same blocks are reused.
//!
//! The trim threshold does not cover a whole heap of a thread's arena (glibc gives each device
//! thread an arena of 64 MiB heaps): when the newest heap is left empty, `free` unmaps it unless
//! the top pad could not be kept, so a device whose step spills past one heap unmapped and
//! re-faulted it every step. A top pad of one heap keeps it. Measured (`perf stat -e
//! page-faults`, qwen3-peer, data=4, GA 4, 20 steps): 360 k → 64 k page faults (the rest are
//! start-up), 50 `munmap`s of a heap per device thread in 10 steps → none; peak RSS unchanged.

/// The largest mmap threshold glibc accepts on 64-bit targets (half its 64 MiB heap size):
/// blocks up to this size come from the arenas and are reused after free.
const MMAP_THRESHOLD_BYTES: libc::c_int = 32 << 20;

/// Free memory at the top of a heap is returned to the kernel only past this much.
const TRIM_THRESHOLD_BYTES: libc::c_int = 1 << 30;

/// Free memory kept at the top of a heap, and so the size below which an empty thread-arena heap
/// is never unmapped (glibc's per-thread heaps are at most 64 MiB).
const TOP_PAD_BYTES: libc::c_int = 64 << 20;

/// Sets the policy (see the module docs). Call first thing in `main`, before any thread
/// starts; returns whether glibc took all three settings (other C libraries do not have `mallopt`'s
/// parameters and are left as they are).
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only sets allocator tunables; it is called before any other thread
        // exists, as glibc requires for changing them.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
                && libc::mallopt(libc::M_TOP_PAD, TOP_PAD_BYTES) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
