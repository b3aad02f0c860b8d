//! Code point classes as llama.cpp's pre-tokenizers see them, and GPT-2's
//! byte-to-character mapping.

use crate::unicode_table::CLASS_RUNS;
use std::sync::OnceLock;

/// The general-category group of a code point (Unicode 15.1, the version
/// llama.cpp's `unicode-data.cpp` was generated from).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Class {
    Unassigned = 0,
    Number = 1,
    Letter = 2,
    Separator = 3,
    Mark = 4,
    Punctuation = 5,
    Symbol = 6,
    Control = 7,
}

impl Class {
    fn from_id(id: u32) -> Class {
        match id {
            1 => Class::Number,
            2 => Class::Letter,
            3 => Class::Separator,
            4 => Class::Mark,
            5 => Class::Punctuation,
            6 => Class::Symbol,
            7 => Class::Control,
            _ => Class::Unassigned,
        }
    }
}

pub(crate) fn class_of(c: char) -> Class {
    let cp = c as u32;
    // Runs are sorted by start; the last run starting at or before `cp` holds it.
    let idx = CLASS_RUNS.partition_point(|&run| (run >> 8) <= cp);
    Class::from_id(CLASS_RUNS[idx.saturating_sub(1)] & 0xff)
}

/// The Unicode `White_Space` property (PropList.txt), which is what llama.cpp
/// treats as `\s`.
pub(crate) fn is_whitespace(c: char) -> bool {
    matches!(
        c as u32,
        0x09..=0x0d | 0x20 | 0x85 | 0xa0 | 0x1680 | 0x2000..=0x200a | 0x2028 | 0x2029 | 0x202f | 0x205f | 0x3000
    )
}

/// What the pre-tokenizer splitters need to know about one code point.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CharInfo {
    pub class: Class,
    pub whitespace: bool,
}

impl CharInfo {
    pub fn of(c: char) -> CharInfo {
        CharInfo { class: class_of(c), whitespace: is_whitespace(c) }
    }
    pub fn is_letter(self) -> bool {
        self.class == Class::Letter
    }
    pub fn is_number(self) -> bool {
        self.class == Class::Number
    }
    pub fn is_mark(self) -> bool {
        self.class == Class::Mark
    }
}

/// GPT-2's reversible byte encoding: printable Latin-1 bytes map to
/// themselves, the other bytes to U+0100 onwards, in byte order.
pub(crate) struct ByteMap {
    pub to_char: [char; 256],
    /// Indexed by code point; only U+0000..U+0143 are used by the encoding.
    from_char: [Option<u8>; 0x144],
}

impl ByteMap {
    pub fn get() -> &'static ByteMap {
        static MAP: OnceLock<ByteMap> = OnceLock::new();
        MAP.get_or_init(|| {
            let printable =
                |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
            let mut to_char = ['\0'; 256];
            let mut from_char = [None; 0x144];
            let mut next = 0x100u32;
            for b in 0..256u32 {
                let cp = if printable(b) {
                    b
                } else {
                    next += 1;
                    next - 1
                };
                let c = char::from_u32(cp).expect("code points below U+0144 are valid");
                to_char[b as usize] = c;
                from_char[cp as usize] = Some(b as u8);
            }
            ByteMap { to_char, from_char }
        })
    }

    pub fn byte_of(&self, c: char) -> Option<u8> {
        self.from_char.get(c as usize).copied().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        assert_eq!(class_of('a'), Class::Letter);
        assert_eq!(class_of('7'), Class::Number);
        assert_eq!(class_of(' '), Class::Separator);
        assert_eq!(class_of('\n'), Class::Control);
        assert_eq!(class_of('$'), Class::Symbol);
        assert_eq!(class_of('!'), Class::Punctuation);
        assert_eq!(class_of('\u{301}'), Class::Mark);
        assert_eq!(class_of('中'), Class::Letter);
        assert_eq!(class_of('😀'), Class::Symbol);
        assert_eq!(class_of('\u{2ffc}'), Class::Symbol); // assigned in Unicode 15.1
        assert_eq!(class_of('\u{1cc00}'), Class::Unassigned); // assigned only in 16.0
        assert_eq!(class_of('\u{10ffff}'), Class::Unassigned);
        assert_eq!(class_of('\u{f0000}'), Class::Control); // private use
    }

    #[test]
    fn byte_map_round_trips() {
        let map = ByteMap::get();
        assert_eq!(map.to_char[b' ' as usize], 'Ġ');
        assert_eq!(map.to_char[b'\n' as usize], 'Ċ');
        assert_eq!(map.to_char[b'a' as usize], 'a');
        for b in 0..=255u8 {
            assert_eq!(map.byte_of(map.to_char[b as usize]), Some(b));
        }
        assert_eq!(map.byte_of('中'), None);
    }
}
