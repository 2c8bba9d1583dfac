//! The `Host` check, a defence against DNS rebinding: without an API key, a web page anywhere could point a name
//! it controls at 127.0.0.1 and then call a local server as its own origin (the browser's same-origin rule sees
//! one host), reading every reply. Such a request names the page's host in its `Host` header, so without
//! `--api-key` a request is served only when its `Host` is an IP address (a browser that asked for an address
//! reached the server it meant), `localhost` or a name under `.localhost`, the `--host` the server listens on,
//! this machine's name (alone or under `.local`), or a name in `--allowed-hosts` (`.example.com`: it and every
//! name under it; `*`: any). Others get 403. A request without `Host` (HTTP/1.0 tools; a browser always sends
//! one) passes. With a key there is no check: a rebinding page cannot know the key.

use std::net::IpAddr;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::api::{clip, ApiError};
use crate::{ServeOptions, Shared};

/// The names a request without a key may use; `None` where anything goes (a key, or `--allowed-hosts '*'`).
pub(crate) struct Allowed {
    /// Exact names, lower case.
    names: Vec<String>,
    /// Suffixes, with their leading dot: a name ending in one, or equal to it without the dot, is allowed.
    suffixes: Vec<String>,
}

impl Allowed {
    pub fn new(opts: &ServeOptions) -> Option<Allowed> {
        if opts.api_key.is_some() || opts.allowed_hosts.iter().any(|h| h == "*") {
            return None;
        }
        let mut names = vec!["localhost".to_owned(), normal(&opts.host)];
        if let Some(me) = machine_name() {
            names.push(format!("{me}.local"));
            names.push(me);
        }
        let mut suffixes = vec![".localhost".to_owned()];
        for h in &opts.allowed_hosts {
            let h = normal(h);
            match h.starts_with('.') {
                true => suffixes.push(h),
                false => names.push(h),
            }
        }
        Some(Allowed { names, suffixes })
    }

    /// Whether a request whose `Host` header is `host` (with or without a port) may be served.
    pub fn allows(&self, host: &str) -> bool {
        let name = normal(strip_port(host));
        name.parse::<IpAddr>().is_ok()
            || self.names.contains(&name)
            || self.suffixes.iter().any(|s| name.ends_with(s.as_str()) || name == s[1..])
    }
}

/// Lower case, without a trailing dot (`localhost.` is `localhost`) or the brackets of an IPv6 address.
fn normal(host: &str) -> String {
    let h = host.trim().trim_end_matches('.');
    let h = h.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(h);
    h.to_ascii_lowercase()
}

/// `host:port` → `host`; `[v6]:port` → `[v6]`; a bare IPv6 address stays as it is.
fn strip_port(host: &str) -> &str {
    if let Some(end) = host.strip_prefix('[').and_then(|h| h.find(']')) {
        return &host[..end + 2];
    }
    match host.rsplit_once(':') {
        Some((h, port)) if !h.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

/// This machine's name (gethostname), lower case.
fn machine_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer it is given.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0)?;
    let name = std::str::from_utf8(&buf[..end]).ok()?;
    (!name.is_empty()).then(|| normal(name))
}

/// 403 for a request whose `Host` is not allowed (see the module).
pub(crate) async fn check(State(st): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(allowed) = &st.hosts {
        let host = match req.headers().get(header::HOST) {
            Some(h) => Some(h.to_str().unwrap_or("?")),
            None => req.uri().authority().map(|a| a.as_str()),
        };
        if let Some(host) = host.filter(|h| !allowed.allows(h)) {
            let msg = format!(
                "this server does not answer to the name '{}' (the request's Host header): without --api-key it \
                 serves only localhost, IP addresses, its --host and the names in --allowed-hosts, so that a web \
                 page cannot reach it through a name of its own (DNS rebinding); add the name to --allowed-hosts \
                 or set --api-key",
                clip(host)
            );
            return ApiError {
                close: true,
                ..ApiError::new(StatusCode::FORBIDDEN, "invalid_request_error", "host_not_allowed", msg)
            }
            .into_response();
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(hosts: &[&str], host: &str) -> Option<Allowed> {
        let opts = ServeOptions {
            host: host.into(),
            allowed_hosts: hosts.iter().map(|h| h.to_string()).collect(),
            ..ServeOptions::default()
        };
        Allowed::new(&opts)
    }

    #[test]
    fn names_addresses_and_ports() {
        let a = allowed(&["tern.internal", ".example.com"], "0.0.0.0").unwrap();
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "[::1]:8080",
            "[::1]",
            "::1",
            "192.168.1.20:8080",
            "localhost:8080",
            "LOCALHOST",
            "localhost.",
            "app.localhost:3000",
            "tern.internal:8080",
            "example.com",
            "api.example.com:443",
            "0.0.0.0:8080",
        ] {
            assert!(a.allows(ok), "{ok}");
        }
        for bad in [
            "evil.com",
            "evil.com:8080",
            "localhost.evil.com",
            "127.0.0.1.nip.io",
            "notexample.com",
            "tern.internal.evil.com",
            "",
            "[::1",
        ] {
            assert!(!a.allows(bad), "{bad}");
        }
        let named = allowed(&[], "my-box.lan").unwrap();
        assert!(named.allows("my-box.lan:8080") && !named.allows("other.lan"));
        assert!(allowed(&["*"], "127.0.0.1").is_none(), "* allows every name");
        let keyed = ServeOptions { api_key: Some("k".into()), ..ServeOptions::default() };
        assert!(Allowed::new(&keyed).is_none(), "with a key, no check");
    }
}
