//! Printing the expert cache's counters.

use ts_model::StatsSnapshot;

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// One line: hit rate, bytes read (and per token when `tokens` > 0), read and wait time.
pub fn summary(s: &StatsSnapshot, tokens: usize) -> String {
    let t = s.total();
    let per_token =
        if tokens > 0 { format!(" ({:.2} MiB/token)", mib(t.bytes_read) / tokens as f64) } else { String::new() };
    let on_host = if t.on_host > 0 { format!(" ({} computed on the CPU)", t.on_host) } else { String::new() };
    format!(
        "expert cache: {} slots x {:.2} MiB, policy {}, {}; hits {} misses {}{on_host} (hit rate {:.1}%), prefetched {}, read {:.1} MiB{per_token}, read time {:.2} s, compute waited {}",
        s.slots,
        mib(s.slot_bytes as u64),
        s.policy,
        s.source,
        t.hits,
        t.misses,
        100.0 * t.hit_rate(),
        t.prefetched,
        mib(t.bytes_read),
        t.read_time.as_secs_f64(),
        if s.measures_wait { format!("{:.2} s", t.wait_time.as_secs_f64()) } else { "(not measured)".into() }
    )
}

/// A table with one row per MoE layer, then the summary.
pub fn table(s: &StatsSnapshot, tokens: usize) -> String {
    let mut out = String::from("layer    hits  misses  hit%    MiB read  read ms  wait ms\n");
    for (i, l) in s.layers.iter().enumerate() {
        if l.hits + l.misses == 0 {
            continue;
        }
        let wait = if s.measures_wait { format!("{:.0}", l.wait_time.as_secs_f64() * 1e3) } else { "-".into() };
        out += &format!(
            "{i:>5} {:>7} {:>7} {:>5.1} {:>11.1} {:>8.0} {wait:>8}\n",
            l.hits,
            l.misses,
            100.0 * l.hit_rate(),
            mib(l.bytes_read),
            l.read_time.as_secs_f64() * 1e3,
        );
    }
    out + &summary(s, tokens) + "\n"
}
