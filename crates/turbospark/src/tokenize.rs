//! `turbospark tokenize`: token ids of a text, as llama.cpp's `llama-tokenize --ids` prints them.

use anyhow::{Context, Result, bail};
use std::io::Read;
use std::path::{Path, PathBuf};
use ts_tokenizer::Tokenizer;

#[derive(clap::Args)]
pub struct Args {
    /// The text to tokenize.
    #[arg(short = 'p', long = "prompt")]
    prompt: Option<String>,
    /// Read the text from a file.
    #[arg(short = 'f', long = "file", conflicts_with = "prompt")]
    file: Option<PathBuf>,
    /// Read the text from standard input.
    #[arg(long, conflicts_with_all = ["prompt", "file"])]
    stdin: bool,
    /// Do not add the BOS/EOS tokens the model asks for.
    #[arg(long)]
    no_bos: bool,
    /// Treat special-token text (e.g. `<|im_start|>`) as plain text.
    #[arg(long)]
    no_parse_special: bool,
    /// Print one `id<TAB>piece` line per token instead of the JSON array.
    #[arg(long)]
    pieces: bool,
}

fn text(args: &Args) -> Result<String> {
    if let Some(p) = &args.prompt {
        return Ok(p.clone());
    }
    let bytes = if let Some(f) = &args.file {
        std::fs::read(f).with_context(|| format!("reading {}", f.display()))?
    } else if args.stdin {
        let mut buf = Vec::new();
        std::io::stdin().read_to_end(&mut buf).context("reading standard input")?;
        buf
    } else {
        bail!("no text given: pass -p TEXT, -f FILE or --stdin");
    };
    String::from_utf8(bytes).context("the text is not valid UTF-8")
}

pub fn run(model: &Path, args: &Args) -> Result<()> {
    let text = text(args)?;
    let tokenizer = Tokenizer::from_gguf(model).context("loading the tokenizer")?;
    let ids = tokenizer.encode(&text, !args.no_bos, !args.no_parse_special)?;
    let out = if args.pieces {
        let mut s = String::new();
        for &id in &ids {
            let piece = tokenizer.token_to_piece(id, true)?;
            s += &format!("{id}\t{:?}\n", String::from_utf8_lossy(&piece));
        }
        s
    } else {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        format!("[{}]\n", list.join(", "))
    };
    crate::write_stdout(out.as_bytes())
}
