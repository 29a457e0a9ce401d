//! What the bench reads about server processes from Linux `/proc`: who listens on a
//! port, CPU time spent, resident memory.

use std::process::Command;

use anyhow::Context;

/// The process listening on TCP `port` on this machine (Linux `/proc`: the socket's
/// inode in `/proc/net/tcp{,6}`, then the process holding it), if it can be found.
pub fn pid_listening_on(port: u16) -> Option<u32> {
    let inode = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .find_map(|table| {
            let text = std::fs::read_to_string(table).ok()?;
            text.lines().skip(1).find_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let local_port = fields.get(1)?.rsplit_once(':')?.1;
                let listening = fields.get(3)? == &"0A";
                (listening && u16::from_str_radix(local_port, 16).ok()? == port)
                    .then(|| fields.get(9).map(|i| i.to_string()))
                    .flatten()
            })
        })?;
    let wanted = format!("socket:[{inode}]");
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let fds = std::fs::read_dir(entry.path().join("fd")).ok()?;
            fds.flatten()
                .any(|fd| {
                    std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == wanted)
                })
                .then_some(pid)
        })
}

/// User + system CPU seconds of the processes `pids` (Linux `/proc`); `None` elsewhere.
pub fn cpu_seconds(pids: &[u32]) -> Option<f64> {
    let ticks_per_s = Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse::<f64>().ok())
        .unwrap_or(100.0);
    let mut total = 0.0;
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the parenthesised command name: utime and stime are 14 and 15.
        let rest = stat.rsplit_once(')')?.1;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let utime: f64 = fields.get(11)?.parse().ok()?;
        let stime: f64 = fields.get(12)?.parse().ok()?;
        total += (utime + stime) / ticks_per_s;
    }
    Some(total)
}

/// Resident memory of process `pid` (Linux `/proc`).
pub fn rss_bytes(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .context("no VmRSS")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kb * 1024)
}
