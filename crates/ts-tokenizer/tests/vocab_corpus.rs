//! llama.cpp's tokenizer test vectors: every `.inp`/`.out` pair shipped with
//! its `models/ggml-vocab-*.gguf` files (fetched by tools/fetch-vocab-corpus.sh, which
//! tools/test.sh runs: an absent corpus is a failure).
//! The vectors were made with `add_special = false, parse_special = false`
//! (llama.cpp's tests/test-tokenizer-0.cpp).

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use ts_tokenizer::Tokenizer;

/// Vocabularies that must load and pass; a regression here is a failure, not a skip.
const MUST_PASS: &[&str] = &[
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "qwen2",
    "qwen35",
    "phi-3",
    "starcoder",
    "refact",
    "command-r",
    "mpt",
    "falcon",
    "deepseek-llm",
    "deepseek-coder",
    "gemma-4",
];

/// Test cases of one vocabulary: input text and expected ids. Inputs are
/// separated by "\n__ggml_vocab_test__\n"; each output line holds the ids of
/// one input, separated by spaces.
fn read_cases(inp: &Path, out: &Path) -> Vec<(String, Vec<u32>)> {
    const SEPARATOR: &str = "\n__ggml_vocab_test__\n";
    let raw = fs::read_to_string(inp).unwrap();
    // A separator at the very end closes the last input; it does not open an empty one.
    let mut inputs = Vec::new();
    let mut rest = raw.as_str();
    while !rest.is_empty() {
        let (input, after) = rest.split_once(SEPARATOR).unwrap_or((rest, ""));
        inputs.push(input);
        rest = after;
    }
    let outputs = fs::read_to_string(out).unwrap();
    let outputs: Vec<Vec<u32>> =
        outputs.lines().map(|line| line.split_whitespace().map(|id| id.parse().unwrap()).collect()).collect();
    assert_eq!(inputs.len(), outputs.len(), "{}: inputs and outputs differ in number", inp.display());
    inputs.into_iter().map(String::from).zip(outputs).collect()
}

enum Outcome {
    Passed(usize),
    Skipped(String),
    Failed(Vec<String>),
}

fn check_vocab(gguf: &Path) -> Outcome {
    let file = match ts_gguf::GgufFile::open(gguf) {
        Ok(f) => f,
        Err(e) => return Outcome::Failed(vec![format!("cannot open: {e}")]),
    };
    let tok = match Tokenizer::from_metadata(file.metadata()) {
        Ok(t) => t,
        Err(e) => return Outcome::Skipped(e.to_string()),
    };
    let inp = PathBuf::from(format!("{}.inp", gguf.display()));
    let out = PathBuf::from(format!("{}.out", gguf.display()));
    if !inp.exists() || !out.exists() {
        return Outcome::Skipped(
            "loads; llama.cpp ships no .inp/.out vectors for it (see vocabularies_on_committed_texts)".into(),
        );
    }
    let cases = read_cases(&inp, &out);
    let mut failures = Vec::new();
    for (text, expected) in &cases {
        match tok.encode(text, false, false) {
            Ok(ids) if &ids == expected => {}
            Ok(ids) => failures.push(format!("{text:?}\n    expected {expected:?}\n    got      {ids:?}")),
            Err(e) => failures.push(format!("{text:?}: {e}")),
        }
    }
    if failures.is_empty() { Outcome::Passed(cases.len()) } else { Outcome::Failed(failures) }
}

#[test]
fn llama_cpp_vocab_test_vectors() {
    let dir = common::models_dir().join("vocab");
    let entries =
        fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}: run tools/fetch-vocab-corpus.sh", dir.display()));
    let mut vocabs: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with("ggml-vocab-"))
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    vocabs.sort();
    let outcomes: Vec<(String, Outcome)> = std::thread::scope(|scope| {
        let handles: Vec<_> = vocabs
            .iter()
            .map(|path| {
                let name = path.file_stem().unwrap().to_str().unwrap().trim_start_matches("ggml-vocab-").to_string();
                (name, scope.spawn(move || check_vocab(path)))
            })
            .collect();
        handles.into_iter().map(|(name, h)| (name, h.join().unwrap())).collect()
    });

    let mut problems = Vec::new();
    for (name, outcome) in &outcomes {
        match outcome {
            Outcome::Passed(n) => println!("pass  {name:<16} {n} cases identical to llama.cpp"),
            Outcome::Skipped(why) => {
                println!("skip  {name:<16} {why}");
                if MUST_PASS.contains(&name.as_str()) {
                    problems.push(format!("{name} was skipped: {why}"));
                }
            }
            Outcome::Failed(failures) => {
                println!("FAIL  {name:<16} {} cases differ", failures.len());
                for f in failures {
                    println!("    {f}");
                }
                problems.push(format!("{name}: {} cases differ", failures.len()));
            }
        }
    }
    for name in MUST_PASS {
        if !outcomes.iter().any(|(n, _)| n == name) {
            problems.push(format!("{name} is missing from {}", dir.display()));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Special ids and end-of-generation sets as llama.cpp reports them when
/// loading these vocabularies (`print_info` in its load log).
#[test]
fn special_ids_match_llama_cpp() {
    let dir = common::models_dir().join("vocab");
    assert!(dir.exists(), "{} is absent: run tools/fetch-vocab-corpus.sh", dir.display());
    struct Expected {
        name: &'static str,
        bos: Option<u32>,
        eos: Option<u32>,
        eot: Option<u32>,
        newline: Option<u32>,
        eog: &'static [u32],
    }
    let e = |name, bos, eos, eot, newline, eog| Expected { name, bos, eos, eot, newline, eog };
    let cases = [
        e("llama-bpe", Some(128000), Some(128001), Some(128009), Some(198), &[128001, 128009]),
        e("gemma-4", Some(2), Some(1), None, Some(107), &[1, 50, 106]),
        e("phi-3", Some(1), Some(32000), Some(32007), Some(13), &[2, 32000, 32007]),
        e("command-r", Some(5), Some(255001), None, Some(206), &[0, 255001]),
        e("deepseek-coder", Some(32013), Some(32014), Some(32014), Some(185), &[32014]),
        e("llama-spm", Some(1), Some(2), None, Some(13), &[2]),
    ];
    for case in cases {
        let tok = Tokenizer::from_gguf(dir.join(format!("ggml-vocab-{}.gguf", case.name))).unwrap();
        let s = tok.special_tokens();
        assert_eq!((s.bos, s.eos, s.eot, s.newline), (case.bos, case.eos, case.eot, case.newline), "{}", case.name);
        assert_eq!(tok.eog_tokens(), case.eog, "{}", case.name);
    }
}

/// Every pre-tokenizer in tests/data/expected/pre: the qwen2 test vocabulary
/// relabelled with it, on the multilingual text, against llama-tokenize's ids
/// for the same relabelled file (tools/tokenizer-reference/gen.sh).
#[test]
fn pre_tokenizer_variants_match_llama_cpp() {
    let vocab = common::models_dir().join("vocab/ggml-vocab-qwen2.gguf");
    assert!(vocab.exists(), "{} is absent: run tools/fetch-vocab-corpus.sh", vocab.display());
    let file = ts_gguf::GgufFile::open(&vocab).unwrap();
    let text = fs::read_to_string(common::data_dir().join("multilingual.txt")).unwrap();
    let mut expected: Vec<PathBuf> =
        fs::read_dir(common::data_dir().join("expected/pre")).unwrap().map(|e| e.unwrap().path()).collect();
    expected.sort();
    assert!(expected.len() >= 40);
    let check = |path: &PathBuf| -> Result<String, String> {
        let pre = path.file_stem().unwrap().to_str().unwrap();
        let raw = fs::read_to_string(path).unwrap();
        let want: Vec<u32> = raw
            .trim()
            .trim_matches(|c| c == '[' || c == ']')
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.trim().parse().unwrap())
            .collect();
        let mut md = file.metadata().clone();
        md.insert("tokenizer.ggml.pre".into(), ts_gguf::Value::String(pre.into()));
        let tok = Tokenizer::from_metadata(&md).map_err(|e| format!("{pre}: {e}"))?;
        let got = tok.encode(&text, false, false).unwrap();
        if got == want {
            return Ok(format!("pass  pre {pre:<24} {} ids", got.len()));
        }
        let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
        let show = |ids: &[u32]| ids[at..(at + 6).min(ids.len())].to_vec();
        Err(format!("{pre}: first difference at {at}: got {:?}, want {:?}", show(&got), show(&want)))
    };
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let results: Vec<Result<String, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let (expected, check) = (&expected, &check);
                scope.spawn(move || expected.iter().skip(w).step_by(workers).map(check).collect::<Vec<_>>())
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    report(results);
}

/// Prints the passes and skips in name order and fails on any mismatch.
fn report(results: Vec<Result<String, String>>) {
    let (mut lines, mismatches): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
    lines.sort_by_key(|line| line.as_ref().map(|l| l.get(6..).unwrap_or(l).to_string()).unwrap_or_default());
    for line in lines.into_iter().flatten() {
        println!("{line}");
    }
    let mismatches: Vec<String> = mismatches.into_iter().filter_map(Result::err).collect();
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

/// Every test vocabulary on the committed multilingual and special-token
/// texts, against llama-tokenize (tools/tokenizer-reference/gen.sh); this
/// covers the vocabularies llama.cpp ships without .inp/.out vectors.
#[test]
fn vocabularies_on_committed_texts() {
    let dir = common::models_dir().join("vocab");
    assert!(dir.exists(), "{} is absent: run tools/fetch-vocab-corpus.sh", dir.display());
    let expected_dir = common::data_dir().join("expected/vocab");
    let mut names: Vec<String> = fs::read_dir(&expected_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_str().unwrap().split('.').next().unwrap().to_string())
        .collect();
    names.sort();
    names.dedup();
    let check = |name: &String| -> Result<String, String> {
        let tok = match Tokenizer::from_gguf(dir.join(format!("ggml-vocab-{name}.gguf"))) {
            Ok(tok) => tok,
            Err(e) => return Ok(format!("skip  {name:<16} {e}")),
        };
        for (text, variant, parse_special) in [("multilingual", "plain", false), ("specials", "parse-special", true)] {
            let input = fs::read_to_string(common::data_dir().join(format!("{text}.txt"))).unwrap();
            let raw = fs::read_to_string(expected_dir.join(format!("{name}.{text}.{variant}.ids"))).unwrap();
            let want: Vec<u32> = raw
                .trim()
                .trim_matches(|c| c == '[' || c == ']')
                .split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|s| s.trim().parse().unwrap())
                .collect();
            let got = tok.encode(&input, false, parse_special).unwrap();
            if got != want {
                let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
                let show = |ids: &[u32]| ids[at..(at + 6).min(ids.len())].to_vec();
                return Err(format!(
                    "{name} {text}: first difference at {at}: got {:?}, want {:?}",
                    show(&got),
                    show(&want)
                ));
            }
        }
        Ok(format!("pass  {name:<16} multilingual and special-token texts"))
    };
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let results: Vec<Result<String, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let (names, check) = (&names, &check);
                scope.spawn(move || names.iter().skip(w).step_by(workers).map(check).collect::<Vec<_>>())
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    report(results);
}
