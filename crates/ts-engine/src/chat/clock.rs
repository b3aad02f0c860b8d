//! The date and time `strftime_now` formats, with the C `strftime`
//! conversions chat templates use (in the C locale, as Python's
//! `datetime.strftime` passes them to the C library).

use std::fmt::Write;

/// A calendar date and time of day (proleptic Gregorian, no time zone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DateTime {
    pub year: i32,
    /// 1 to 12.
    pub month: u32,
    /// 1 to 31.
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];

impl DateTime {
    /// The time `secs` seconds after 1970-01-01T00:00:00 UTC.
    pub fn from_unix(secs: i64) -> DateTime {
        let days = secs.div_euclid(86_400);
        let in_day = secs.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        DateTime { year, month, day, hour: in_day / 3600, minute: in_day / 60 % 60, second: in_day % 60 }
    }

    /// Now, in UTC.
    pub fn now_utc() -> DateTime {
        let secs = match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            Ok(d) => d.as_secs() as i64,
            Err(e) => -(e.duration().as_secs() as i64),
        };
        DateTime::from_unix(secs)
    }

    /// `YYYY-MM-DD` or `YYYY-MM-DDTHH:MM:SS` (Python's `datetime.fromisoformat` basics).
    pub fn parse_iso(text: &str) -> Option<DateTime> {
        let (date, time) = text.split_once(['T', ' ']).unwrap_or((text, "00:00:00"));
        let mut d = date.splitn(3, '-');
        let year = d.next()?.parse().ok()?;
        let month = d.next()?.parse().ok()?;
        let day = d.next()?.parse().ok()?;
        let mut t = time.splitn(3, ':');
        let hour = t.next()?.parse().ok()?;
        let minute = t.next()?.parse().ok()?;
        let second = t.next().map_or(Some(0), |s| s.parse().ok())?;
        let valid = (1..=12).contains(&month)
            && day >= 1
            && day <= days_in_month(year, month)
            && hour < 24
            && minute < 60
            && second < 60;
        valid.then_some(DateTime { year, month, day, hour, minute, second })
    }

    /// Day of the week, 0 = Sunday.
    pub fn weekday(&self) -> u32 {
        // 1970-01-01 was a Thursday.
        (days_from_civil(self.year, self.month, self.day) + 4).rem_euclid(7) as u32
    }

    /// Day of the year, 1 = January 1st.
    pub fn ordinal(&self) -> u32 {
        (days_from_civil(self.year, self.month, self.day) - days_from_civil(self.year, 1, 1)) as u32 + 1
    }

    /// C `strftime` in the C locale: `%Y %m %d %H %M %S %y %B %b %h %A %a %j
    /// %I %p %e %F %T %D %R %c %x %X %Z %z %%`, with glibc's `-` flag (no
    /// padding). Other conversions are written as they are.
    pub fn strftime(&self, format: &str) -> String {
        let mut out = String::with_capacity(format.len() + 16);
        let mut chars = format.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let unpadded = chars.next_if_eq(&'-').is_some();
            let Some(conv) = chars.next() else {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                break;
            };
            let num = |out: &mut String, value: u32, width: usize| {
                let _ = if unpadded { write!(out, "{value}") } else { write!(out, "{value:0width$}") };
            };
            let hour12 = if self.hour.is_multiple_of(12) { 12 } else { self.hour % 12 };
            match conv {
                'Y' => {
                    let _ = write!(out, "{}", self.year);
                }
                'y' => num(&mut out, self.year.rem_euclid(100) as u32, 2),
                'm' => num(&mut out, self.month, 2),
                'd' => num(&mut out, self.day, 2),
                'e' => {
                    let _ = if unpadded { write!(out, "{}", self.day) } else { write!(out, "{:2}", self.day) };
                }
                'H' => num(&mut out, self.hour, 2),
                'I' => num(&mut out, hour12, 2),
                'M' => num(&mut out, self.minute, 2),
                'S' => num(&mut out, self.second, 2),
                'j' => num(&mut out, self.ordinal(), 3),
                'p' => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
                'B' => out.push_str(MONTHS[self.month as usize - 1]),
                'b' | 'h' => out.push_str(&MONTHS[self.month as usize - 1][..3]),
                'A' => out.push_str(WEEKDAYS[self.weekday() as usize]),
                'a' => out.push_str(&WEEKDAYS[self.weekday() as usize][..3]),
                'F' => out.push_str(&self.strftime("%Y-%m-%d")),
                'T' => out.push_str(&self.strftime("%H:%M:%S")),
                'R' => out.push_str(&self.strftime("%H:%M")),
                'D' | 'x' => out.push_str(&self.strftime("%m/%d/%y")),
                'X' => out.push_str(&self.strftime("%H:%M:%S")),
                'c' => out.push_str(&self.strftime("%a %b %e %H:%M:%S %Y")),
                'Z' | 'z' => {}
                'n' => out.push('\n'),
                't' => out.push('\t'),
                '%' => out.push('%'),
                other => {
                    out.push('%');
                    if unpadded {
                        out.push('-');
                    }
                    out.push(other);
                }
            }
        }
        out
    }
}

fn is_leap(year: i32) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

fn days_in_month(year: i32, month: u32) -> u32 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date, counting in 400-year
/// eras of 146097 days with years starting in March (so the leap day is last).
fn days_from_civil(year: i32, month: u32, day: u32) -> i64 {
    let y = i64::from(year) - i64::from(month <= 2);
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let month_from_march = (i64::from(month) + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// The inverse of [`days_from_civil`].
fn civil_from_days(days: i64) -> (i32, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z - era * 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_from_march + 2) / 5 + 1) as u32;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 } as u32;
    let year = (year_of_era + era * 400 + i64::from(month <= 2)) as i32;
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_times_to_dates() {
        assert_eq!(DateTime::from_unix(0), DateTime { year: 1970, month: 1, day: 1, hour: 0, minute: 0, second: 0 });
        // 2000-02-29T12:34:56Z
        assert_eq!(
            DateTime::from_unix(951_827_696),
            DateTime { year: 2000, month: 2, day: 29, hour: 12, minute: 34, second: 56 }
        );
        assert_eq!(
            DateTime::from_unix(-1),
            DateTime { year: 1969, month: 12, day: 31, hour: 23, minute: 59, second: 59 }
        );
    }

    #[test]
    fn days_round_trip() {
        for days in (-800_000..800_000).step_by(97) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn strftime_conversions() {
        let t = DateTime::parse_iso("2025-03-07T14:05:09").unwrap();
        assert_eq!(t.strftime("%Y-%m-%d"), "2025-03-07");
        assert_eq!(t.strftime("%d %b %Y"), "07 Mar 2025");
        assert_eq!(t.strftime("%B %d, %Y"), "March 07, 2025");
        assert_eq!(t.strftime("%A %a %j %I:%M %p %-d %e"), "Friday Fri 066 02:05 PM 7  7");
        assert_eq!(t.strftime("%c|%%|%Q"), "Fri Mar  7 14:05:09 2025|%|%Q");
    }

    #[test]
    fn iso_parsing_rejects_impossible_dates() {
        assert!(DateTime::parse_iso("2025-02-29").is_none());
        assert!(DateTime::parse_iso("2024-02-29").is_some());
        assert!(DateTime::parse_iso("2025-13-01T00:00:00").is_none());
    }
}
