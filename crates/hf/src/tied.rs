//! A tied model's head stored anyway: a directory whose `config.json` ties the output head to
//! the input embedding (`tie_word_embeddings: true`) and whose weights still hold
//! `lm_head.weight`. Qwen/Qwen3-0.6B on the Hub is one: its head is a copy of the embedding.
//!
//! transformers decides by the values (`tie_weights` compares the two with `torch.equal`), and
//! so does ferrotext:
//! - a head equal to the embedding, value for value, is the tie stored twice: the model loads
//!   tied and the copy is read by nothing;
//! - a head with values of its own is a model of its own: transformers keeps it untied (and
//!   warns), [`crate::read_config`] reads such a directory with `logits_via_embedding` false,
//!   and a model that ties anyway (`logits_via_embedding=true` set by hand) refuses the head,
//!   named, rather than drop it.
//!
//! DeepSeek-V3's multi-token-prediction layer stores copies the same way: its `embed_tokens` and
//! `shared_head.head` are the main model's embedding and head, shared
//! ([`ferrotext_models::mtp::stored_copies`]). A copy is read as the sharing itself; a tensor
//! with values of its own would be a layer trained apart from the main model, which the module
//! cannot be: it is refused, named ([`drop_copies`]).

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::convert::{self, Stored};
use crate::shards::{locate, map_files, parse_headers, release, shard_files, tensor_names};

/// The decoder's name of the input embedding, `[vocab, d]`.
pub(crate) const EMBEDDING: &str = "model.embed_tokens.weight";
/// The decoder's name of the output head, stored `[vocab, d]` as the embedding is.
pub(crate) const HEAD: &str = "lm_head.weight";

/// What a directory's weights hold under the head's name, beside its embedding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StoredHead {
    /// No head: the layout a tie is saved in.
    Absent,
    /// A head equal to the embedding, value for value (`-0` equal to `0`, in any two of F32,
    /// BF16 and F16): the tie stored twice.
    Copy,
    /// A head of its own: other values, another shape, an unsupported dtype, or no embedding
    /// to compare it with.
    Own,
}

/// What `located` holds under `head` beside `embedding` (both as the checkpoint names them).
///
/// # Errors
/// A header entry that cannot be read as a tensor.
pub(crate) fn stored_head(
    shards: &[SafeTensors<'_>],
    located: &BTreeMap<String, usize>,
    (embedding, head): (&str, &str),
) -> Result<StoredHead, String> {
    let Some(&h) = located.get(head) else {
        return Ok(StoredHead::Absent);
    };
    let Some(&e) = located.get(embedding) else {
        return Ok(StoredHead::Own);
    };
    let view = |s: usize, name: &str| shards[s].tensor(name).map_err(|x| format!("`{name}`: {x}"));
    Ok(if same_values(&view(h, head)?, &view(e, embedding)?) {
        StoredHead::Copy
    } else {
        StoredHead::Own
    })
}

/// Takes each stored copy in `copies` (`(copy, of)`, checkpoint names) out of `located` once it
/// is found equal to the tensor it copies, its pages released, so that nothing reads it again;
/// an absent copy is fine (the copied tensor is what the model reads).
///
/// # Errors
/// A copy with values of its own (or nothing to compare it with), named with what it should
/// copy; a header entry that cannot be read as a tensor.
pub(crate) fn drop_copies(
    maps: &[memmap2::Mmap],
    shards: &[SafeTensors<'_>],
    located: &mut BTreeMap<String, usize>,
    copies: &[(String, String)],
) -> Result<(), String> {
    for (copy, of) in copies {
        match stored_head(shards, located, (of, copy))? {
            StoredHead::Absent => {}
            StoredHead::Copy => {
                if let Some(s) = located.remove(copy) {
                    release(&maps[s], &shards[s], copy);
                }
            }
            StoredHead::Own => {
                return Err(format!(
                    "`{copy}` is not a copy of `{of}`: the multi-token-prediction layer shares \
                     the main model's embedding and output head (the DeepSeek-V3 report, \
                     MaxText, transformers' MtpModel), and the published checkpoint stores \
                     copies of them; a layer with tensors of its own cannot be trained as that \
                     module, so it is refused rather than dropped"
                ))
            }
        }
    }
    Ok(())
}

/// What the HF directory `dir`'s weights hold under the head's name beside its embedding, in
/// its family's checkpoint names; [`StoredHead::Absent`] when it has no weights file. The pages
/// compared are released after.
///
/// # Errors
/// An index or a header that does not parse; a file that cannot be read.
pub(crate) fn directory_head(dir: &Path) -> Result<StoredHead, String> {
    let (embedding, head) = names(crate::family::checkpoint_names(dir));
    // The names first (the index alone, when sharded): most tied directories store no head.
    if !tensor_names(dir)?.is_some_and(|names| names.contains(&head)) {
        return Ok(StoredHead::Absent);
    }
    let (files, index) = shard_files(dir)?;
    let maps = map_files(dir, &files, index.is_some())?;
    let shards = parse_headers(&maps, &files)?;
    let located = locate(&shards, &files, index.as_ref())?;
    let found = stored_head(&shards, &located, (&embedding, &head))?;
    for name in [&embedding, &head] {
        if let Some(&s) = located.get(name.as_str()) {
            release(&maps[s], &shards[s], name);
        }
    }
    Ok(found)
}

/// Whether the HF directory `dir`'s `config.json` ties the head to the embedding while its
/// weights store a head of its own, so that [`crate::read_config`] reads it untied (what
/// transformers 5 warns of on load): for a run's header to say so. `false` when the config or
/// the weights cannot be read (the load reports that).
pub fn head_untied_by_its_weights(dir: &Path) -> bool {
    let tied = ferrotext_files::read_regular_to_string(&dir.join(crate::CONFIG_FILE))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .and_then(|value| crate::config_from_json(&value).ok())
        .is_some_and(|cfg| cfg.logits_via_embedding);
    tied && directory_head(dir) == Ok(StoredHead::Own)
}

/// The embedding's and the head's names as a family's checkpoints store them.
pub(crate) fn names(rename: fn(&str) -> Option<String>) -> (String, String) {
    let stored = |n: &str| rename(n).unwrap_or_else(|| n.to_string());
    (stored(EMBEDDING), stored(HEAD))
}

/// Whether `a` and `b` hold the same values: the same shape, and element for element equal
/// once widened to f32 (so a BF16 copy of an F32 tensor's BF16 values is the same, and `-0`
/// equals `0`). Equal bytes of one dtype decide it without widening.
fn same_values(a: &TensorView<'_>, b: &TensorView<'_>) -> bool {
    if a.shape() != b.shape() {
        return false;
    }
    if a.dtype() == b.dtype() && a.data() == b.data() {
        return true;
    }
    let (Some(ka), Some(kb)) = (stored(a.dtype()), stored(b.dtype())) else {
        return false;
    };
    const CHUNK: usize = 4096;
    let (mut x, mut y) = (vec![0f32; CHUNK], vec![0f32; CHUNK]);
    let chunks_a = a.data().chunks(CHUNK * ka.size());
    let chunks_b = b.data().chunks(CHUNK * kb.size());
    chunks_a.len() == chunks_b.len()
        && chunks_a.zip(chunks_b).all(|(ca, cb)| {
            let n = ca.len() / ka.size();
            n == cb.len() / kb.size() && {
                convert::decode(ca, ka, &mut x[..n]);
                convert::decode(cb, kb, &mut y[..n]);
                x[..n] == y[..n]
            }
        })
}

/// How a tensor of `dtype` is stored, `None` for a dtype the loader does not read.
fn stored(dtype: Dtype) -> Option<Stored> {
    match dtype {
        Dtype::F32 => Some(Stored::F32),
        Dtype::BF16 => Some(Stored::Bf16),
        Dtype::F16 => Some(Stored::F16),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(dtype: Dtype, shape: &[usize], data: &'a [u8]) -> TensorView<'a> {
        TensorView::new(dtype, shape.to_vec(), data).expect("a consistent test tensor")
    }

    fn f32_bytes(x: &[f32]) -> Vec<u8> {
        x.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn bf16_bytes(x: &[f32]) -> Vec<u8> {
        x.iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect()
    }

    /// Values across chunks (5,000 > one chunk of 4,096), each exact in F32, BF16 and F16.
    fn values() -> Vec<f32> {
        (0..5000)
            .map(|i| ((i % 255) as f32 - 127.0) * 0.5)
            .collect()
    }

    #[test]
    fn equal_values_are_the_same_in_any_two_stored_dtypes() {
        let v = values();
        let (f, b) = (f32_bytes(&v), bf16_bytes(&v));
        let h = half_bytes(&v);
        let shape = [50, 100];
        for (da, a) in [(Dtype::F32, &f), (Dtype::BF16, &b), (Dtype::F16, &h)] {
            for (db, bb) in [(Dtype::F32, &f), (Dtype::BF16, &b), (Dtype::F16, &h)] {
                assert!(
                    same_values(&view(da, &shape, a), &view(db, &shape, bb)),
                    "{da:?} against {db:?}"
                );
            }
        }
        // -0 and 0 are equal values with other bytes.
        let (zero, minus) = (f32_bytes(&[0.0, 1.0]), f32_bytes(&[-0.0, 1.0]));
        assert!(same_values(
            &view(Dtype::F32, &[2], &zero),
            &view(Dtype::F32, &[2], &minus)
        ));
    }

    fn half_bytes(x: &[f32]) -> Vec<u8> {
        x.iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect()
    }

    #[test]
    fn one_other_value_or_another_shape_is_not_the_same() {
        let v = values();
        let mut w = v.clone();
        w[4999] += 0.5;
        let f = f32_bytes(&v);
        for (dtype, other) in [(Dtype::F32, f32_bytes(&w)), (Dtype::BF16, bf16_bytes(&w))] {
            assert!(!same_values(
                &view(Dtype::F32, &[50, 100], &f),
                &view(dtype, &[50, 100], &other)
            ));
        }
        // the same bytes in another shape
        assert!(!same_values(
            &view(Dtype::F32, &[50, 100], &f),
            &view(Dtype::F32, &[100, 50], &f)
        ));
        // a dtype the loader does not read is never the same as another dtype's values
        let ints: Vec<u8> = (0..5000i32).flat_map(|i| i.to_le_bytes()).collect();
        assert!(!same_values(
            &view(Dtype::F32, &[50, 100], &f),
            &view(Dtype::I32, &[50, 100], &ints)
        ));
    }
}
