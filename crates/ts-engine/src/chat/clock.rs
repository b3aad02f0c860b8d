//! The date and time `strftime_now` formats, with the C `strftime`
//! conversions chat templates use (in the C locale, as Python's
//! `datetime.strftime` passes them to the C library); the calendar is chrono's.

use chrono::{NaiveDate, NaiveDateTime, Utc};
use std::fmt::Write;

/// A calendar date and time of day (proleptic Gregorian, no time zone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DateTime(NaiveDateTime);

impl DateTime {
    /// The time `secs` seconds after 1970-01-01T00:00:00 UTC (`None` out of chrono's range).
    pub fn from_unix(secs: i64) -> Option<DateTime> {
        chrono::DateTime::from_timestamp(secs, 0).map(|t| DateTime(t.naive_utc()))
    }

    /// Now, in UTC.
    pub fn now_utc() -> DateTime {
        DateTime(Utc::now().naive_utc())
    }

    /// `YYYY-MM-DD` or `YYYY-MM-DDTHH:MM[:SS]` (Python's `datetime.fromisoformat` basics).
    pub fn parse_iso(text: &str) -> Option<DateTime> {
        let with_time = |t: &str| {
            ["%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M"]
                .iter()
                .find_map(|f| NaiveDateTime::parse_from_str(t, f).ok())
        };
        with_time(text)
            .or_else(|| NaiveDate::parse_from_str(text, "%Y-%m-%d").ok().and_then(|d| d.and_hms_opt(0, 0, 0)))
            .map(DateTime)
    }

    /// C `strftime` in the C locale: `%Y %m %d %H %M %S %y %B %b %h %A %a %j
    /// %I %p %e %F %T %D %R %c %x %X %n %t %%` (chrono's conversions, which are
    /// the C locale's), with glibc's `-` flag (no padding); `%Z` and `%z` are
    /// empty for a time without a zone, as in Python. Other conversions are
    /// written as they are.
    pub fn strftime(&self, format: &str) -> String {
        let mut out = String::with_capacity(format.len() + 16);
        let mut chars = format.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let unpadded = chars.next_if_eq(&'-').is_some();
            let flag = if unpadded { "-" } else { "" };
            match chars.next() {
                None => out.push_str(&format!("%{flag}")),
                Some('Z' | 'z') => {}
                Some(conv) if "YmdHMSyBbhAajIpeFTDRcxXnt%".contains(conv) => {
                    let _ = write!(out, "{}", self.0.format(&format!("%{flag}{conv}")));
                }
                Some(other) => out.push_str(&format!("%{flag}{other}")),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_times_to_dates() {
        let at = |secs| DateTime::from_unix(secs).unwrap().strftime("%F %T");
        assert_eq!(at(0), "1970-01-01 00:00:00");
        assert_eq!(at(951_827_696), "2000-02-29 12:34:56");
        assert_eq!(at(-1), "1969-12-31 23:59:59");
    }

    #[test]
    fn strftime_conversions() {
        let t = DateTime::parse_iso("2025-03-07T14:05:09").unwrap();
        assert_eq!(t.strftime("%Y-%m-%d"), "2025-03-07");
        assert_eq!(t.strftime("%d %b %Y"), "07 Mar 2025");
        assert_eq!(t.strftime("%B %d, %Y"), "March 07, 2025");
        assert_eq!(t.strftime("%A %a %j %I:%M %p %-d %e"), "Friday Fri 066 02:05 PM 7  7");
        assert_eq!(
            t.strftime("%c|%%|%Q|%Z%z|%x %X %D %R"),
            "Fri Mar  7 14:05:09 2025|%|%Q||03/07/25 14:05:09 03/07/25 14:05"
        );
        assert_eq!(t.strftime("%-m/%-d %-H:%M%"), "3/7 14:05%");
    }

    #[test]
    fn iso_parsing_rejects_impossible_dates() {
        assert!(DateTime::parse_iso("2025-02-29").is_none());
        assert!(DateTime::parse_iso("2024-02-29").is_some());
        assert!(DateTime::parse_iso("2025-13-01T00:00:00").is_none());
        assert_eq!(DateTime::parse_iso("2025-03-07 14:05").unwrap().strftime("%T"), "14:05:00");
    }
}
