//! A `tokenizer.json` written here (a WordPiece and a byte-level BPE, learnt from the synthetic
//! corpus) encodes a text file exactly as the `tokenizers` crate does when called directly.

use datasets::tokenizer::{Kind, Tokenizer};

fn text() -> String {
    // Words the tokenizers never saw, so that WordPiece must cut them into pieces.
    datasets::text::synthetic_corpus(7, 20_000)
        + "\nthe carolbird quickly repaints seventeen lamps.\n"
}

#[test]
fn trained_tokenizers_encode_as_the_tokenizers_crate_does() {
    let dir = std::env::temp_dir().join(format!("datasets-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let training = datasets::text::synthetic_corpus(3, 20_000);
    for (kind, vocab) in [(Kind::WordPiece, 300), (Kind::ByteLevelBpe, 320)] {
        let path = dir.join(format!("{kind:?}.json"));
        let ours = Tokenizer::train(kind, &training, vocab, &path).unwrap();
        assert!(
            ours.vocab_size() <= vocab && ours.vocab_size() > 100,
            "{kind:?}: {} tokens",
            ours.vocab_size()
        );
        let direct = tokenizers::Tokenizer::from_file(&path).unwrap();
        let text = text();
        let ids = ours.encode(&text).unwrap();
        assert_eq!(
            ids,
            direct.encode(text.as_str(), false).unwrap().get_ids(),
            "{kind:?}: the whole text"
        );
        let lines = ours.encode_lines(&text).unwrap();
        let expected: Vec<Vec<u32>> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| direct.encode(l, false).unwrap().get_ids().to_vec())
            .collect();
        assert_eq!(lines, expected, "{kind:?}: one document per line");

        let tokens =
            direct.encode("the carolbird quickly repaints", false).unwrap().get_tokens().to_vec();
        match kind {
            Kind::WordPiece => {
                assert!(
                    tokens.iter().any(|t| t.starts_with("##")),
                    "unseen words are cut into sub-words: {tokens:?}"
                );
                for special in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] {
                    assert!(ours.token_id(special).is_some(), "{special}");
                }
            }
            Kind::ByteLevelBpe => {
                assert!(
                    tokens.len() < "the carolbird quickly repaints".len(),
                    "merges shorten the text: {tokens:?}"
                );
                assert!(ours.token_id("<|endoftext|>").is_some());
            }
        }
    }
    let err = Tokenizer::from_file(&dir.join("missing.json")).err().unwrap().to_string();
    assert!(err.contains("missing.json"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
