//! Text ↔ token ids for generation: a Hugging Face `tokenizer.json` (the `tokenizers` crate), or
//! bytes (what a model trained on the bundled corpus or a text file without a tokenizer reads),
//! and a streaming decoder that prints each token's text as soon as it is whole.
//!
//! Invariant: the concatenation of everything [`StreamDecoder::push`] and
//! [`StreamDecoder::finish`] return is the decoding of all the ids pushed (after the prompt's
//! text, for [`StreamDecoder::after`]).

use std::path::Path;

use crate::error::GenerateError;

/// How text becomes ids and back.
pub enum TextCodec {
    /// One id per byte (ids 0..256).
    Bytes,
    /// A Hugging Face tokenizer (boxed: it is large).
    Tokenizer(Box<tokenizers::Tokenizer>),
}

impl TextCodec {
    /// The tokenizer at `path` (a `tokenizer.json`).
    ///
    /// # Errors
    /// [`GenerateError::Usage`] (key `tokenizer_path`) for a file that cannot be read or is not a
    /// tokenizer.
    pub fn from_file(path: &Path) -> Result<TextCodec, GenerateError> {
        let bytes = ferrotext_files::read_named(path)
            .map_err(|e| GenerateError::usage("tokenizer_path", format!("tokenizer_path: {e}")))?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            GenerateError::usage(
                "tokenizer_path",
                format!("{} is not a tokenizer: {e}", path.display()),
            )
        })?;
        Ok(TextCodec::Tokenizer(Box::new(tokenizer)))
    }

    /// `text`'s ids, with the tokenizer's own special tokens as transformers' `tokenizer(text)`
    /// gives them (the BOS that Llama 3's, Gemma's and Mistral's templates put in front).
    ///
    /// # Errors
    /// [`GenerateError::Usage`] (key `prompt`) when the tokenizer fails on it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, GenerateError> {
        match self {
            TextCodec::Bytes => Ok(text.bytes().map(u32::from).collect()),
            TextCodec::Tokenizer(t) => {
                t.encode(text, true)
                    .map(|e| e.get_ids().to_vec())
                    .map_err(|e| {
                        GenerateError::usage("prompt", format!("cannot tokenize the prompt: {e}"))
                    })
            }
        }
    }

    /// The text of `ids` (invalid UTF-8 and unknown ids become U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            TextCodec::Bytes => {
                let bytes: Vec<u8> = ids
                    .iter()
                    .map(|&i| u8::try_from(i).unwrap_or(b'?'))
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            TextCodec::Tokenizer(t) => t.decode(ids, false).unwrap_or_else(|_| "\u{FFFD}".into()),
        }
    }

    /// How many ids the codec knows (256 for bytes; the tokenizer's size with added tokens).
    pub fn vocab_size(&self) -> usize {
        match self {
            TextCodec::Bytes => 256,
            TextCodec::Tokenizer(t) => t.get_vocab_size(true),
        }
    }
}

/// Turns ids into text as they come, holding back a token whose text is not yet whole (a UTF-8
/// sequence split across byte tokens, or a tokenizer's partial character).
pub struct StreamDecoder<'c> {
    codec: &'c TextCodec,
    ids: Vec<u32>,
    emitted: usize,
}

impl<'c> StreamDecoder<'c> {
    /// A decoder with nothing pushed.
    pub fn new(codec: &'c TextCodec) -> StreamDecoder<'c> {
        StreamDecoder {
            codec,
            ids: Vec::new(),
            emitted: 0,
        }
    }

    /// A decoder continuing `prompt`: what it returns is the text the new ids add to the
    /// prompt's (so a tokenizer that joins words with spaces puts one before the first new word).
    pub fn after(codec: &'c TextCodec, prompt: &[u32]) -> StreamDecoder<'c> {
        StreamDecoder {
            codec,
            ids: prompt.to_vec(),
            emitted: codec.decode(prompt).len(),
        }
    }

    /// The new text `id` completes (empty while a character is still partial).
    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        let text = self.codec.decode(&self.ids);
        if text.ends_with('\u{FFFD}') {
            return String::new();
        }
        self.take_new(&text)
    }

    /// Whatever is still held back (a partial character at the end, as U+FFFD).
    pub fn finish(&mut self) -> String {
        let text = self.codec.decode(&self.ids);
        self.take_new(&text)
    }

    fn take_new(&mut self, text: &str) -> String {
        // A tokenizer may rewrite earlier text (e.g. a space merged away); then emit nothing
        // until the text again extends what was printed.
        match text.get(self.emitted..) {
            Some(new) => {
                self.emitted = text.len();
                new.to_string()
            }
            None => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_stream_whole_characters() {
        let codec = TextCodec::Bytes;
        let text = "a é ☃ z";
        let ids = codec.encode(text).unwrap();
        assert_eq!(ids.len(), text.len());
        assert_eq!(codec.decode(&ids), text);
        let mut stream = StreamDecoder::new(&codec);
        let mut pieces: Vec<String> = ids.iter().map(|&i| stream.push(i)).collect();
        pieces.push(stream.finish());
        assert_eq!(pieces.concat(), text);
        // the snowman's three bytes come out at once, at its last byte
        assert!(pieces.iter().any(|p| p == "☃"), "{pieces:?}");
        // after a prompt: only what the new ids add
        let mut stream = StreamDecoder::after(&codec, &ids[..2]);
        let rest: String = ids[2..].iter().map(|&i| stream.push(i)).collect();
        assert_eq!(rest + &stream.finish(), &text[2..]);
    }

    /// A prompt gets the BOS the tokenizer's template puts in front (`<s>` 14 before `the` 2,
    /// `cat` 3), and the stream after it prints only the new text.
    #[test]
    fn a_prompt_is_encoded_with_the_tokenizers_template() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tests/fixtures");
        let with_bos = TextCodec::from_file(&fixtures.join("wordlevel_bos.json")).unwrap();
        let ids = with_bos.encode("the cat").unwrap();
        assert_eq!(ids, vec![14, 2, 3]);
        let plain = TextCodec::from_file(&fixtures.join("wordlevel.json")).unwrap();
        assert_eq!(plain.encode("the cat").unwrap(), vec![2, 3]);
        let mut stream = StreamDecoder::after(&with_bos, &ids);
        let new = stream.push(4) + &stream.finish();
        assert_eq!(new.trim(), "dog");
    }

    #[test]
    fn a_partial_character_at_the_end_comes_out_as_a_replacement() {
        let codec = TextCodec::Bytes;
        let mut stream = StreamDecoder::new(&codec);
        assert_eq!(stream.push(u32::from(b'x')), "x");
        assert_eq!(stream.push(0xE2), "");
        assert_eq!(stream.finish(), "\u{FFFD}");
    }
}
