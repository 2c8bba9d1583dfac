//! Images in requests: the image parts of every API (OpenAI chat `image_url`, Responses `input_image`, Anthropic
//! `image` blocks, which the front ends write as chat `image_url` parts) read into bytes, bounded, measured from
//! their headers and decoded into the tower's [`Pixels`].
//!
//! Images come inline as `data:` URLs with base64 PNG or JPEG. http(s) URLs are a 400 unless the server fetches
//! them (`--image-urls`, [`ImageFetch`]): then they are fetched here with ureq, within the byte bound, one total
//! timeout per request, a few redirects, and only from global addresses (every address a name resolves to, at
//! every hop, is checked by the agent's resolver, and the connection goes to the addresses checked, so a name that
//! changes its answer between the check and the connection (DNS rebinding) reaches nothing private).
//! Every bound is a 400 naming it: images per request ([`ImageLimits::max_images`]), bytes per image
//! ([`ImageLimits::max_bytes`], checked before the base64 is decoded) and pixels per image
//! ([`ImageLimits::max_pixels`], read from the image's header before anything is decoded, and enforced again by the
//! decoder's own limits, so that a small file declaring a huge image, a decompression bomb, costs nothing). All of
//! it runs on the preparation pool ([`crate::prep`]), never on the async workers.

use std::io::{Cursor, Read as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs as _};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use tern_engine::model::ImageInput;
use tern_engine::Image;
use tern_model::vision::Pixels;

use crate::api::{clip, ApiError};

/// The bounds on a request's images (`--max-images`, `--max-image-bytes`, `--max-image-pixels`) and whether and how
/// http(s) image URLs are fetched.
#[derive(Clone, Debug)]
pub struct ImageLimits {
    /// Images in one request, all messages together.
    pub max_images: usize,
    /// Bytes of one image file (decoded from its base64).
    pub max_bytes: usize,
    /// Pixels (width × height) of one image as stored, before the processor resizes it.
    pub max_pixels: u64,
    /// http(s) image URLs: refused unless [`ImageFetch::enabled`].
    pub fetch: ImageFetch,
}

impl Default for ImageLimits {
    /// 32 images, 8 MiB each (the default body cap allows 6 MiB of base64-encoded image), 25 megapixels each (a
    /// 6K screenshot; its RGBA decode takes 100 MB); image URLs not fetched.
    fn default() -> ImageLimits {
        ImageLimits { max_images: 32, max_bytes: 8 << 20, max_pixels: 25_000_000, fetch: ImageFetch::default() }
    }
}

/// Fetching http(s) image URLs (`--image-urls`, `--image-url-timeout`). The body is held to
/// [`ImageLimits::max_bytes`]; only global addresses are reached ([`non_global`]).
#[derive(Clone, Debug)]
pub struct ImageFetch {
    /// Fetch http(s) image URLs (off: each is a 400 asking for a data: URL).
    pub enabled: bool,
    /// All the fetches of one request together: name lookups, connections, redirects and bodies. The request
    /// holds a preparation slot ([`crate::prep`]) for at most this long while it fetches.
    pub timeout: Duration,
    /// Redirects followed for one image.
    pub max_redirects: usize,
    /// Addresses reached although they are not global. For tests (a server on loopback); empty by default, and
    /// only a hidden flag sets it.
    pub allow_addresses: Vec<IpAddr>,
}

impl Default for ImageFetch {
    /// Off; 5 seconds a request; 3 redirects.
    fn default() -> ImageFetch {
        ImageFetch { enabled: false, timeout: Duration::from_secs(5), max_redirects: 3, allow_addresses: Vec::new() }
    }
}

/// An image of a request: its file's bytes and where it came from (for errors).
pub(crate) struct ImageBytes {
    pub bytes: Vec<u8>,
    /// The request field holding it.
    pub param: String,
    /// 1-based, in the order of the request.
    pub ordinal: usize,
    /// Image tokens it takes in the prompt (from its header: see [`probe`]).
    pub tokens: usize,
}

/// The supported file formats.
const FORMATS: &str = "PNG or JPEG";

fn invalid(param: &str, message: String) -> ApiError {
    ApiError { code: Some("invalid_image"), ..ApiError::invalid(param, message) }
}

/// The 400 of an image part sent to a model that reads none.
pub(crate) fn unsupported(param: &str) -> ApiError {
    ApiError {
        code: Some("images_unsupported"),
        ..ApiError::invalid(
            param,
            "this server's model does not read images: its checkpoint has no vision weights (model.visual.*), or \
             its backend does not run the vision tower; send text only",
        )
    }
}

/// The bytes of an image part's URL, at most `limits.max_bytes`: a `data:` URL with base64 content (checked before
/// decoding), or with [`ImageFetch::enabled`] an http(s) URL, fetched ([`fetch`]) by `deadline`, which the first
/// fetch of a request sets (refused otherwise).
pub(crate) fn from_url(
    url: &str,
    param: &str,
    ordinal: usize,
    limits: &ImageLimits,
    deadline: &mut Option<Instant>,
) -> Result<Vec<u8>, ApiError> {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https:/") {
        if !limits.fetch.enabled {
            return Err(invalid(
                param,
                format!(
                    "image {ordinal}: image URLs are not fetched by this server ('{}'); send the image inline as a \
                     data: URL (data:image/png;base64,...)",
                    clip(url)
                ),
            ));
        }
        let by = *deadline.get_or_insert_with(|| Instant::now() + limits.fetch.timeout);
        return fetch(url, limits, by).map_err(|e| {
            let code = if e.too_large { "image_too_large" } else { "invalid_image" };
            ApiError { code: Some(code), ..ApiError::invalid(param, format!("image {ordinal}: {}", e.message)) }
        });
    }
    let Some(rest) = url.strip_prefix("data:").or_else(|| lower.starts_with("data:").then(|| &url[5..])) else {
        return Err(invalid(
            param,
            format!(
                "image {ordinal}: expected a data: URL with a base64 {FORMATS} image (data:image/png;base64,...), got \
                 '{}'",
                clip(url)
            ),
        ));
    };
    let Some((meta, data)) = rest.split_once(',') else {
        return Err(invalid(param, format!("image {ordinal}: a data: URL needs a ',' before its data")));
    };
    let mut meta = meta.split(';').map(str::trim);
    let media = meta.next().unwrap_or_default().to_ascii_lowercase();
    if !meta.any(|p| p.eq_ignore_ascii_case("base64")) {
        return Err(invalid(param, format!("image {ordinal}: the data: URL must be base64 (data:{media};base64,...)")));
    }
    check_media_type(&media, param, ordinal)?;
    from_base64(data, param, ordinal, limits)
}

/// URLs longer than this are refused before they are parsed.
const MAX_URL_BYTES: usize = 8192;

/// Why a fetch failed: a sentence for the client, and whether it is the byte bound.
#[derive(Debug)]
pub(crate) struct FetchError {
    pub message: String,
    pub too_large: bool,
}

impl From<String> for FetchError {
    fn from(message: String) -> FetchError {
        FetchError { message, too_large: false }
    }
}

fn timed_out(f: &ImageFetch) -> String {
    format!(
        "fetching the image URL took longer than {:.1}s, the limit for all of a request's image URLs \
         (--image-url-timeout)",
        f.timeout.as_secs_f64()
    )
}

/// The time left before `deadline`, or the timeout's error when there is none.
fn left(deadline: Instant, f: &ImageFetch) -> Result<Duration, String> {
    deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()).ok_or_else(|| timed_out(f))
}

/// GET an http(s) image URL by `deadline`: at most [`ImageFetch::max_redirects`] redirects, each hop's URL checked
/// ([`check_url`]) and its host's addresses checked as they are resolved ([`resolve`]); a 2xx answer of an image
/// content type (or none, or octet-stream: the bytes' own format is checked when they are probed) and at most
/// [`ImageLimits::max_bytes`] bytes.
pub(crate) fn fetch(url: &str, limits: &ImageLimits, deadline: Instant) -> Result<Vec<u8>, FetchError> {
    let f = &limits.fetch;
    if url.len() > MAX_URL_BYTES {
        return Err(format!("the image URL is {} bytes long, over {MAX_URL_BYTES}", url.len()).into());
    }
    let mut at = check_url(url, &f.allow_addresses)?;
    let mut hops = 0;
    loop {
        // Where the resolver says why it refused (ureq wraps its error).
        let refusal = Arc::new(Mutex::new(None::<String>));
        let agent = agent(f, deadline, refusal.clone())?;
        let answer = agent.request_url("GET", &at).set("Accept", "image/png, image/jpeg").call();
        let refused = || refusal.lock().ok().and_then(|mut r| r.take());
        let resp = match answer {
            Ok(resp) => resp,
            Err(ureq::Error::Status(code, _)) => {
                return Err(format!("the image URL '{}' answered HTTP {code}", clip(at.as_str())).into())
            }
            Err(ureq::Error::Transport(t)) => {
                if let Some(why) = refused() {
                    return Err(why.into());
                }
                if is_timeout(&t) || Instant::now() >= deadline {
                    return Err(timed_out(f).into());
                }
                return Err(format!("the image URL '{}' could not be fetched: {t}", clip(at.as_str())).into());
            }
        };
        let status = resp.status();
        if (300..400).contains(&status) {
            let Some(location) = resp.header("location") else {
                return Err(format!("the image URL answered HTTP {status} without a Location").into());
            };
            hops += 1;
            if hops > f.max_redirects {
                return Err(format!("the image URL redirected more than {} times", f.max_redirects).into());
            }
            let next =
                at.join(location).map_err(|e| format!("the image URL redirected to '{}': {e}", clip(location)))?;
            at = check_url(next.as_str(), &f.allow_addresses)
                .map_err(|e| format!("the image URL redirected to '{}', refused: {e}", clip(next.as_str())))?;
            continue;
        }
        if !(200..300).contains(&status) {
            return Err(format!("the image URL '{}' answered HTTP {status}", clip(at.as_str())).into());
        }
        check_content_type(resp.header("content-type").unwrap_or_default())?;
        let too_large = |n: Option<u64>| FetchError {
            message: format!(
                "the image at the URL is {}over the limit of {} bytes per image (--max-image-bytes)",
                n.map_or_else(String::new, |n| format!("{n} bytes, ")),
                limits.max_bytes
            ),
            too_large: true,
        };
        let declared = resp.header("content-length").and_then(|n| n.trim().parse::<u64>().ok());
        if let Some(n) = declared.filter(|&n| n > limits.max_bytes as u64) {
            return Err(too_large(Some(n)));
        }
        let cap = limits.max_bytes.saturating_add(1);
        let mut bytes = Vec::with_capacity(declared.map_or(64 << 10, |n| n as usize).min(cap));
        let read = resp.into_reader().take(cap as u64).read_to_end(&mut bytes);
        if let Err(e) = read {
            if matches!(e.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock)
                || Instant::now() >= deadline
            {
                return Err(timed_out(f).into());
            }
            return Err(format!("the image URL's body could not be read: {e}").into());
        }
        if bytes.len() > limits.max_bytes {
            return Err(too_large(None));
        }
        return Ok(bytes);
    }
}

/// Whether a transport error is a timeout (of a connection or a read).
fn is_timeout(t: &ureq::Transport) -> bool {
    let mut source = std::error::Error::source(t);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if matches!(io.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock) {
                return true;
            }
        }
        source = e.source();
    }
    false
}

/// An agent for one hop: no proxy, no redirects of its own, no pooled connections, every timeout the time left
/// before `deadline`, and the resolver [`resolve`] (its refusals written to `refusal`).
fn agent(f: &ImageFetch, deadline: Instant, refusal: Arc<Mutex<Option<String>>>) -> Result<ureq::Agent, String> {
    let left = left(deadline, f)?;
    let (allow, f2) = (f.allow_addresses.clone(), f.clone());
    Ok(ureq::AgentBuilder::new()
        .try_proxy_from_env(false)
        .redirects(0)
        .max_idle_connections(0)
        .timeout(left)
        .timeout_connect(left)
        .user_agent(concat!("tern/", env!("CARGO_PKG_VERSION")))
        .resolver(move |netloc: &str| {
            resolve(netloc, deadline, &allow, &f2).map_err(|why| {
                if let Ok(mut r) = refusal.lock() {
                    *r = Some(why.clone());
                }
                std::io::Error::other(why)
            })
        })
        .build())
}

/// The addresses of `netloc` (`host:port`, as ureq asks), every one of them global ([`non_global`]) unless in
/// `allow`; the name is looked up on a thread of its own, waited for until `deadline`.
fn resolve(netloc: &str, deadline: Instant, allow: &[IpAddr], f: &ImageFetch) -> Result<Vec<SocketAddr>, String> {
    let (addrs, host) = match netloc.parse::<SocketAddr>() {
        Ok(a) => (vec![a], a.ip().to_string()),
        Err(_) => {
            let host = netloc.rsplit_once(':').map_or(netloc, |(h, _)| h).to_owned();
            let (tx, rx) = std::sync::mpsc::channel();
            let name = netloc.to_owned();
            std::thread::Builder::new()
                .name("tern-image-dns".into())
                .spawn(move || {
                    let found = name.to_socket_addrs().map(|a| a.take(64).collect::<Vec<_>>());
                    let _ = tx.send(found);
                })
                .map_err(|e| format!("cannot look up '{}': {e}", clip(&host)))?;
            match rx.recv_timeout(left(deadline, f)?) {
                Ok(Ok(addrs)) => (addrs, host),
                Ok(Err(e)) => return Err(format!("the image URL's host '{}' cannot be resolved: {e}", clip(&host))),
                Err(_) => return Err(timed_out(f)),
            }
        }
    };
    if addrs.is_empty() {
        return Err(format!("the image URL's host '{}' has no address", clip(&host)));
    }
    for a in &addrs {
        check_address(a.ip(), &host, allow)?;
    }
    Ok(addrs)
}

/// A 400's sentence when `ip` (of `host`) is not one image URLs may reach.
fn check_address(ip: IpAddr, host: &str, allow: &[IpAddr]) -> Result<(), String> {
    match non_global(ip) {
        Some(class) if !allow.contains(&ip) => {
            let of = if host == ip.to_string() { String::new() } else { format!(" (of '{}')", clip(host)) };
            Err(format!(
                "the image URL's address {ip}{of} is a {class} address; image URLs are fetched only from public \
                 (global) addresses"
            ))
        }
        _ => Ok(()),
    }
}

/// A URL image fetches may start from or be redirected to: http or https, a host, no credentials, and when the
/// host is an IP address, a global one (names are checked as they are resolved).
pub(crate) fn check_url(url: &str, allow: &[IpAddr]) -> Result<url::Url, String> {
    let u = url::Url::parse(url).map_err(|e| format!("'{}' is not a valid URL ({e})", clip(url)))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(format!("only http and https image URLs are fetched, not '{}:'", clip(u.scheme())));
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err("image URLs with credentials (user:password@) are not fetched".to_owned());
    }
    match u.host() {
        None => return Err(format!("the image URL '{}' has no host", clip(url))),
        Some(url::Host::Ipv4(ip)) => check_address(IpAddr::V4(ip), &ip.to_string(), allow)?,
        Some(url::Host::Ipv6(ip)) => check_address(IpAddr::V6(ip), &ip.to_string(), allow)?,
        Some(url::Host::Domain(_)) => {}
    }
    Ok(u)
}

/// The content type of a fetched image, when it cannot be one: none, octet-stream and PNG or JPEG types pass (the
/// bytes' format is checked when they are probed); other image types and everything else are refused.
fn check_content_type(header: &str) -> Result<(), String> {
    let media = header.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    match media.as_str() {
        "" | "image/png" | "image/jpeg" | "image/jpg" | "application/octet-stream" | "binary/octet-stream" => Ok(()),
        m if m.starts_with("image/") => {
            Err(format!("the image URL's content type '{}' is not supported ({FORMATS} images only)", clip(m)))
        }
        m => Err(format!("the image URL's content type is '{}', not an image ({FORMATS} expected)", clip(m))),
    }
}

/// The class of an address image URLs must not reach (private, loopback, link-local, ...), or `None` for a global
/// one. IPv4 as IANA's special-purpose registry lists it; IPv6 outside global unicast (2000::/3) is refused, and
/// within it the registry's special blocks, with the IPv4 address inside mapped, NAT64 and 6to4 addresses judged as
/// IPv4.
pub(crate) fn non_global(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => non_global_v4(v4),
        IpAddr::V6(v6) => non_global_v6(v6),
    }
}

fn non_global_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        _ if ip.is_unspecified() => "unspecified",
        (0, ..) => "reserved (this network)",
        (10, ..) | (172, 16..=31, _) | (192, 168, _) => "private",
        (100, 64..=127, _) => "shared (carrier-grade NAT)",
        (127, ..) => "loopback",
        (169, 254, _) => "link-local",
        (192, 0, 0) => "reserved (IETF protocol assignments)",
        (192, 0, 2) | (198, 51, 100) | (203, 0, 113) => "documentation",
        (192, 88, 99) => "reserved (6to4 relay)",
        (198, 18..=19, _) => "benchmarking",
        (224..=239, ..) => "multicast",
        _ if ip.is_broadcast() => "broadcast",
        (240..=255, ..) => "reserved",
        _ => return None,
    })
}

fn non_global_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    let embedded = |hi: u16, lo: u16| Ipv4Addr::from(((hi as u32) << 16) | lo as u32);
    if ip.is_unspecified() {
        return Some("unspecified");
    }
    if ip.is_loopback() {
        return Some("loopback");
    }
    if let Some(v4) = ip.to_ipv4_mapped() {
        return non_global_v4(v4);
    }
    Some(match s {
        [0, 0, 0, 0, 0, 0, ..] => "reserved (IPv4-compatible)",
        [0x64, 0xff9b, 0, 0, 0, 0, hi, lo] => return non_global_v4(embedded(hi, lo)),
        [0x64, 0xff9b, 1, ..] => "private (local NAT64)",
        [0x2002, hi, lo, ..] => return non_global_v4(embedded(hi, lo)),
        [0x2001, 0xdb8, ..] | [0x3fff, 0..=0x0fff, ..] => "documentation",
        [0x2001, 0..=0x01ff, ..] => "reserved (IETF protocol assignments)",
        [x, ..] if x & 0xfe00 == 0xfc00 => "unique local (private)",
        [x, ..] if x & 0xffc0 == 0xfe80 => "link-local",
        [x, ..] if x & 0xffc0 == 0xfec0 => "site-local",
        [x, ..] if x & 0xff00 == 0xff00 => "multicast",
        [x, ..] if x & 0xe000 != 0x2000 => "reserved",
        _ => return None,
    })
}

/// A declared media type, when it is one tern cannot read (empty and `image/*` types are checked by content).
pub(crate) fn check_media_type(media: &str, param: &str, ordinal: usize) -> Result<(), ApiError> {
    match media.to_ascii_lowercase().as_str() {
        "" | "image/png" | "image/jpeg" | "image/jpg" | "application/octet-stream" => Ok(()),
        m => Err(invalid(
            param,
            format!("image {ordinal}: the media type '{}' is not supported ({FORMATS} images only)", clip(m)),
        )),
    }
}

/// Decode base64 `data` (standard alphabet, padding optional, surrounding whitespace ignored) of at most
/// `limits.max_bytes` decoded bytes.
pub(crate) fn from_base64(data: &str, param: &str, ordinal: usize, limits: &ImageLimits) -> Result<Vec<u8>, ApiError> {
    let data = data.trim();
    // The decoded size, from the length (before any allocation).
    let bytes = data.len() / 4 * 3 + (data.len() % 4).saturating_sub(1);
    if bytes.saturating_sub(2) > limits.max_bytes {
        return Err(ApiError {
            code: Some("image_too_large"),
            ..ApiError::invalid(
                param,
                format!(
                    "image {ordinal} is about {bytes} bytes, over the limit of {} bytes per image (--max-image-bytes)",
                    limits.max_bytes
                ),
            )
        });
    }
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    let out = engine
        .decode(data)
        .map_err(|e| invalid(param, format!("image {ordinal}: the data is not valid base64 ({e})")))?;
    if out.len() > limits.max_bytes {
        return Err(ApiError {
            code: Some("image_too_large"),
            ..ApiError::invalid(
                param,
                format!(
                    "image {ordinal} is {} bytes, over the limit of {} bytes per image (--max-image-bytes)",
                    out.len(),
                    limits.max_bytes
                ),
            )
        });
    }
    Ok(out)
}

/// A reader of `bytes` with their format found from their content (PNG or JPEG, else a 400).
fn reader<'a>(bytes: &'a [u8], param: &str, ordinal: usize) -> Result<image::ImageReader<Cursor<&'a [u8]>>, ApiError> {
    let format = image::guess_format(bytes)
        .map_err(|_| invalid(param, format!("image {ordinal} is not an image tern can read ({FORMATS} expected)")))?;
    if !matches!(format, image::ImageFormat::Png | image::ImageFormat::Jpeg) {
        return Err(invalid(
            param,
            format!("image {ordinal} is {format:?}, which is not supported ({FORMATS} images only)"),
        ));
    }
    Ok(image::ImageReader::with_format(Cursor::new(bytes), format))
}

/// The image's size from its header (nothing decoded), checked against `limits.max_pixels`, and the image tokens it
/// takes in the prompt (the processor's resize, [`tern_model::vision::ImageParams::smart_resize`]).
pub(crate) fn probe(
    bytes: &[u8],
    input: &ImageInput,
    limits: &ImageLimits,
    param: &str,
    ordinal: usize,
) -> Result<usize, ApiError> {
    let (w, h) = reader(bytes, param, ordinal)?
        .into_dimensions()
        .map_err(|e| invalid(param, format!("image {ordinal} cannot be read: {e}")))?;
    let pixels = w as u64 * h as u64;
    if pixels > limits.max_pixels {
        return Err(ApiError {
            code: Some("image_too_large"),
            ..ApiError::invalid(
                param,
                format!(
                    "image {ordinal} is {w}x{h} = {pixels} pixels, over the limit of {} pixels per image \
                     (--max-image-pixels)",
                    limits.max_pixels
                ),
            )
        });
    }
    let p = &input.params;
    let (rh, rw) = p
        .smart_resize(h as usize, w as usize)
        .map_err(|e| invalid(param, format!("image {ordinal} ({w}x{h}) cannot be used: {e}")))?;
    Ok((rh / p.patch_size) * (rw / p.patch_size) / (p.merge_size * p.merge_size))
}

/// Decode and preprocess an image already [`probe`]d, within the decoder's limits (the pixel bound again, and the
/// memory it may take).
pub(crate) fn decode(img: &ImageBytes, input: &ImageInput, limits: &ImageLimits) -> Result<Pixels, ApiError> {
    let (param, ordinal) = (img.param.as_str(), img.ordinal);
    let mut reader = reader(&img.bytes, param, ordinal)?;
    let side = u32::try_from(limits.max_pixels).unwrap_or(u32::MAX);
    let mut l = image::Limits::default();
    l.max_image_width = Some(side);
    l.max_image_height = Some(side);
    // RGBA of 16-bit channels at the pixel bound, and room for the decoder's own buffers.
    l.max_alloc = Some(limits.max_pixels.saturating_mul(8).saturating_add(64 << 20));
    reader.limits(l);
    let decoded = reader.decode().map_err(|e| invalid(param, format!("image {ordinal} cannot be decoded: {e}")))?;
    let pixels = tern_model::vision::preprocess_image(&decoded, &input.params)
        .map_err(|e| invalid(param, format!("image {ordinal} cannot be used: {e}")))?;
    if input.tokens(&pixels) != img.tokens {
        return Err(ApiError::internal(format!(
            "image {ordinal}: the processor gave {} tokens where its header said {}",
            input.tokens(&pixels),
            img.tokens
        )));
    }
    Ok(pixels)
}

/// FNV-1a, 64 bits, of an image's bytes: the same bytes always give the same hash (the prefix cache keys the
/// snapshots after an image by it).
pub(crate) fn hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// The engine's images of `images`, decoded in order.
pub(crate) fn decode_all(
    images: &[ImageBytes],
    input: &ImageInput,
    limits: &ImageLimits,
) -> Result<Vec<Image>, ApiError> {
    images
        .iter()
        .map(|img| {
            Ok(Image { pixels: Arc::new(decode(img, input, limits)?), hash: hash(&img.bytes), tokens: img.tokens })
        })
        .collect()
}

/// `ids` with each of its `pad` tokens (one per image, in order) written `images[i].tokens` times. A 400 when the
/// prompt holds a different number of pads than there are images (the template left an image out, or with
/// `--allow-special-in-content` the text spelled a pad).
pub(crate) fn expand(ids: Vec<u32>, pad: u32, images: &[ImageBytes], param: &str) -> Result<Vec<u32>, ApiError> {
    let pads = ids.iter().filter(|&&t| t == pad).count();
    if pads != images.len() {
        return Err(ApiError::invalid(
            param,
            format!(
                "the rendered prompt holds {pads} image placeholders for {} images (an image the chat template \
                 leaves out, such as one after the text of a continued final message, or an image pad token spelled \
                 in the text)",
                images.len()
            ),
        ));
    }
    if images.is_empty() {
        return Ok(ids);
    }
    let extra: usize = images.iter().map(|i| i.tokens.saturating_sub(1)).sum();
    let mut out = Vec::with_capacity(ids.len() + extra);
    let mut next = images.iter();
    for t in ids {
        if t == pad {
            let n = next.next().map_or(1, |i| i.tokens);
            out.extend(std::iter::repeat_n(pad, n));
        } else {
            out.push(t);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, (x ^ y) as u8]));
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    fn input() -> ImageInput {
        ImageInput { params: tern_model::vision::ImageParams::default(), image_token_id: 9 }
    }

    fn b64(bytes: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    #[test]
    fn data_urls_decode_and_others_are_refused() {
        let l = ImageLimits::default();
        let bytes = png(40, 30);
        let url = format!("data:image/png;base64,{}", b64(&bytes));
        assert_eq!(from_url(&url, "p", 1, &l, &mut None).unwrap(), bytes);
        // Padding optional, media type by content.
        let bare = format!("data:;base64,{}", b64(&bytes).trim_end_matches('='));
        assert_eq!(from_url(&bare, "p", 1, &l, &mut None).unwrap(), bytes);
        for (url, want) in [
            ("https://example.com/cat.png", "not fetched"),
            ("HTTP://example.com/cat.png", "not fetched"),
            ("file:///etc/passwd", "expected a data: URL"),
            ("data:image/png,abc", "must be base64"),
            ("data:image/png;base64", "needs a ','"),
            ("data:image/png;base64,***", "not valid base64"),
            ("data:image/gif;base64,R0lG", "'image/gif' is not supported"),
        ] {
            let e = from_url(url, "p", 3, &l, &mut None).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.contains(want), "{url}: {}", e.message);
            assert!(e.message.starts_with("image 3"), "{}", e.message);
        }
    }

    #[test]
    fn only_global_addresses_pass() {
        let class = |s: &str| non_global(s.parse().unwrap());
        for (ip, want) in [
            ("0.0.0.0", "unspecified"),
            ("0.1.2.3", "reserved"),
            ("10.1.2.3", "private"),
            ("172.16.0.1", "private"),
            ("172.31.255.255", "private"),
            ("192.168.1.1", "private"),
            ("100.64.0.1", "shared"),
            ("127.0.0.1", "loopback"),
            ("127.255.0.9", "loopback"),
            ("169.254.169.254", "link-local"),
            ("192.0.0.8", "reserved"),
            ("192.0.2.1", "documentation"),
            ("198.18.0.1", "benchmarking"),
            ("224.0.0.1", "multicast"),
            ("239.255.255.250", "multicast"),
            ("240.0.0.1", "reserved"),
            ("255.255.255.255", "broadcast"),
            ("::", "unspecified"),
            ("::1", "loopback"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:10.0.0.1", "private"),
            ("::ffff:169.254.169.254", "link-local"),
            ("::127.0.0.1", "IPv4-compatible"),
            ("64:ff9b::a00:1", "private"),
            ("64:ff9b:1::1", "local NAT64"),
            ("2002:c0a8:0101::1", "private"),
            ("2002:7f00:1::1", "loopback"),
            ("2001:db8::1", "documentation"),
            ("2001::1", "IETF"),
            ("fc00::1", "unique local"),
            ("fd12:3456::1", "unique local"),
            ("fe80::1", "link-local"),
            ("febf::1", "link-local"),
            ("fec0::1", "site-local"),
            ("ff02::1", "multicast"),
            ("100::1", "reserved"),
            ("4000::1", "reserved"),
        ] {
            let got = class(ip);
            assert!(got.is_some_and(|c| c.contains(want)), "{ip}: {got:?}, want {want}");
        }
        for ip in [
            "1.1.1.1",
            "8.8.8.8",
            "93.184.216.34",
            "172.15.255.255",
            "172.32.0.1",
            "100.63.255.255",
            "100.128.0.1",
            "169.253.0.1",
            "192.167.1.1",
            "223.255.255.254",
            "2606:4700:4700::1111",
            "2a00:1450:4001::200e",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:808:808::1",
        ] {
            assert_eq!(class(ip), None, "{ip}");
        }
    }

    #[test]
    fn urls_are_checked_before_any_connection() {
        let ok = |u: &str| check_url(u, &[]).map(|u| u.to_string());
        assert_eq!(ok("https://example.com/a.png").unwrap(), "https://example.com/a.png");
        assert!(ok("HTTP://Example.COM:8080/a.png?x=1").is_ok());
        assert!(ok("http://[2606:4700:4700::1111]/a.png").is_ok());
        for (url, want) in [
            ("ftp://example.com/a.png", "only http and https"),
            ("file:///etc/passwd", "only http and https"),
            ("gopher://example.com/", "only http and https"),
            ("http://user:pw@example.com/a.png", "credentials"),
            ("http://user@example.com/a.png", "credentials"),
            ("http://127.0.0.1/a.png", "loopback"),
            ("http://127.1/a.png", "loopback"),
            ("http://2130706433/a.png", "loopback"),
            ("http://0x7f000001/a.png", "loopback"),
            ("http://0/a.png", "unspecified"),
            ("http://10.0.0.1:8080/a.png", "private"),
            ("http://169.254.169.254/latest/meta-data", "link-local"),
            ("http://[::1]/a.png", "loopback"),
            ("http://[::ffff:7f00:1]/a.png", "loopback"),
            ("http://[fd00::1]/a.png", "unique local"),
            ("http://[fe80::1]/a.png", "link-local"),
            ("http://[::1/a.png", "not a valid URL"),
            ("http://exa mple.com/", "not a valid URL"),
        ] {
            let e = ok(url).unwrap_err();
            assert!(e.contains(want), "{url}: {e}");
        }
        // The test-only allowance names exact addresses.
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        assert!(check_url("http://127.0.0.1:9/a.png", &[lo]).is_ok());
        assert!(check_url("http://127.0.0.2:9/a.png", &[lo]).is_err());
        assert!(check_url("http://[::1]:9/a.png", &[lo]).is_err());
    }

    #[test]
    fn every_resolved_address_is_checked() {
        let f = ImageFetch::default();
        let by = Instant::now() + Duration::from_secs(30);
        let e = resolve("127.0.0.1:80", by, &[], &f).unwrap_err();
        assert!(e.contains("127.0.0.1 is a loopback address"), "{e}");
        let e = resolve("[fe80::1]:80", by, &[], &f).unwrap_err();
        assert!(e.contains("link-local"), "{e}");
        let want: SocketAddr = "8.8.8.8:443".parse().unwrap();
        assert_eq!(resolve("8.8.8.8:443", by, &[], &f).unwrap(), vec![want]);
        // A name: every one of its addresses (localhost: 127.0.0.1, and ::1 where the hosts file says so).
        let e = resolve("localhost:80", by, &[], &f).unwrap_err();
        assert!(e.contains("loopback") && e.contains("of 'localhost'"), "{e}");
        let lo: [IpAddr; 2] = ["127.0.0.1".parse().unwrap(), "::1".parse().unwrap()];
        let addrs = resolve("localhost:80", by, &lo, &f).unwrap();
        assert!(!addrs.is_empty() && addrs.iter().all(|a| lo.contains(&a.ip()) && a.port() == 80), "{addrs:?}");
        // Past the deadline nothing is looked up.
        let e = resolve("localhost:80", Instant::now(), &lo, &f).unwrap_err();
        assert!(e.contains("--image-url-timeout"), "{e}");
    }

    #[test]
    fn content_types_of_fetched_images() {
        for ok in ["", "image/png", "IMAGE/JPEG; charset=binary", "application/octet-stream", "binary/octet-stream"] {
            assert!(check_content_type(ok).is_ok(), "{ok}");
        }
        assert!(check_content_type("image/gif").unwrap_err().contains("'image/gif' is not supported"));
        assert!(check_content_type("text/html; charset=utf-8").unwrap_err().contains("'text/html', not an image"));
    }

    /// A loopback HTTP server answering each path from `routes` (its status line and headers, its body, and the
    /// pause between the body's bytes); the base URL.
    fn http_server(routes: Vec<(&'static str, String, Vec<u8>, Duration)>) -> String {
        use std::io::{BufRead as _, BufReader, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            let routes = Arc::new(routes);
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let routes = routes.clone();
                std::thread::spawn(move || {
                    let mut lines = BufReader::new(conn.try_clone().unwrap()).lines();
                    let first = lines.next().and_then(Result::ok).unwrap_or_default();
                    while lines.next().and_then(Result::ok).is_some_and(|l| !l.is_empty()) {}
                    let path = first.split_whitespace().nth(1).unwrap_or_default().to_owned();
                    let Some((_, head, body, pause)) = routes.iter().find(|r| r.0 == path) else {
                        let _ = conn.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
                        return;
                    };
                    let _ = conn.write_all(format!("{head}\r\nConnection: close\r\n\r\n").as_bytes());
                    if pause.is_zero() {
                        let _ = conn.write_all(body);
                        return;
                    }
                    for b in body {
                        std::thread::sleep(*pause);
                        if conn.write_all(&[*b]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        base
    }

    #[test]
    fn fetches_within_every_limit() {
        let img = png(40, 30);
        let n = img.len();
        let ms = Duration::from_millis;
        let base = http_server(vec![
            (
                "/cat.png",
                format!("HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {n}"),
                img.clone(),
                ms(0),
            ),
            ("/bare", "HTTP/1.1 200 OK".into(), img.clone(), ms(0)),
            ("/to-cat", "HTTP/1.1 302 Found\r\nLocation: /cat.png\r\nContent-Length: 0".into(), vec![], ms(0)),
            ("/to-to-cat", "HTTP/1.1 301 Moved\r\nLocation: /to-cat\r\nContent-Length: 0".into(), vec![], ms(0)),
            ("/loop", "HTTP/1.1 307 Again\r\nLocation: /loop\r\nContent-Length: 0".into(), vec![], ms(0)),
            (
                "/to-lo",
                "HTTP/1.1 302 Found\r\nLocation: http://127.0.0.2/x.png\r\nContent-Length: 0".into(),
                vec![],
                ms(0),
            ),
            (
                "/to-meta",
                "HTTP/1.1 302 Found\r\nLocation: http://169.254.169.254/\r\nContent-Length: 0".into(),
                vec![],
                ms(0),
            ),
            (
                "/to-file",
                "HTTP/1.1 302 Found\r\nLocation: file:///etc/passwd\r\nContent-Length: 0".into(),
                vec![],
                ms(0),
            ),
            ("/big", "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 5000".into(), vec![0; 5000], ms(0)),
            ("/big-unsized", "HTTP/1.1 200 OK\r\nContent-Type: image/png".into(), vec![0; 5000], ms(0)),
            ("/html", "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 2".into(), b"hi".to_vec(), ms(0)),
            ("/slow", "HTTP/1.1 200 OK\r\nContent-Type: image/png".into(), img.clone(), ms(200)),
        ]);
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let f = ImageFetch { enabled: true, timeout: ms(1500), allow_addresses: vec![lo], ..ImageFetch::default() };
        let l = ImageLimits { max_bytes: 4096, fetch: f, ..ImageLimits::default() };
        let get = |path: &str| fetch(&format!("{base}{path}"), &l, Instant::now() + l.fetch.timeout);
        assert_eq!(get("/cat.png").unwrap(), img);
        assert_eq!(get("/bare").unwrap(), img);
        assert_eq!(get("/to-to-cat").unwrap(), img);
        for (path, want) in [
            ("/loop", "redirected more than 3 times"),
            ("/to-lo", "127.0.0.2 is a loopback address"),
            ("/to-meta", "169.254.169.254 is a link-local address"),
            ("/to-file", "only http and https"),
            ("/nowhere", "answered HTTP 404"),
            ("/html", "'text/html', not an image"),
        ] {
            let e = get(path).unwrap_err();
            assert!(e.message.contains(want) && !e.too_large, "{path}: {}", e.message);
        }
        for path in ["/big", "/big-unsized"] {
            let e = get(path).unwrap_err();
            assert!(e.too_large && e.message.contains("over the limit of 4096 bytes"), "{path}: {}", e.message);
        }
        let t0 = Instant::now();
        let e = get("/slow").unwrap_err();
        assert!(e.message.contains("longer than 1.5s") && e.message.contains("--image-url-timeout"), "{}", e.message);
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        // Without the allowance, the same server is refused before anything is sent.
        let strict = ImageLimits { fetch: ImageFetch { allow_addresses: vec![], ..l.fetch.clone() }, ..l.clone() };
        let e = fetch(&format!("{base}/cat.png"), &strict, Instant::now() + Duration::from_secs(5)).unwrap_err();
        assert!(e.message.contains("loopback"), "{}", e.message);
        // Through from_url: off, a 400 asking for a data: URL; on, a request's fetches share one deadline.
        let off = ImageLimits::default();
        let e = from_url(&format!("{base}/cat.png"), "p", 2, &off, &mut None).unwrap_err();
        assert!(e.message.contains("not fetched"), "{}", e.message);
        let mut by = None;
        assert_eq!(from_url(&format!("{base}/cat.png"), "p", 1, &l, &mut by).unwrap(), img);
        let set = by.unwrap();
        assert_eq!(from_url(&format!("{base}/to-cat"), "p", 2, &l, &mut by).unwrap(), img);
        assert_eq!(by, Some(set));
        let e = from_url(&format!("{base}/big"), "p", 3, &l, &mut by).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code), (400, Some("image_too_large")));
        assert!(e.message.starts_with("image 3: "), "{}", e.message);
        let e = from_url(&format!("{base}/cat.png"), "p", 4, &l, &mut Some(Instant::now())).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code), (400, Some("invalid_image")));
        assert!(e.message.contains("--image-url-timeout"), "{}", e.message);
    }

    #[test]
    fn byte_limit_is_checked_before_decoding() {
        let l = ImageLimits { max_bytes: 100, ..ImageLimits::default() };
        let e = from_base64(&"A".repeat(1000), "p", 1, &l).unwrap_err();
        assert_eq!(e.code, Some("image_too_large"));
        assert!(e.message.contains("--max-image-bytes"), "{}", e.message);
        assert_eq!(from_base64(&b64(&[7; 100]), "p", 1, &l).unwrap(), vec![7; 100]);
        assert!(from_base64(&b64(&[7; 101]), "p", 1, &l).is_err());
    }

    #[test]
    fn probe_counts_tokens_as_the_processor_does() {
        let l = ImageLimits::default();
        for (w, h) in [(64, 64), (40, 30), (300, 97), (33, 700)] {
            let bytes = png(w, h);
            let tokens = probe(&bytes, &input(), &l, "p", 1).unwrap();
            let img = ImageBytes { bytes, param: "p".into(), ordinal: 1, tokens };
            let pixels = decode(&img, &input(), &l).unwrap();
            assert_eq!(pixels.tokens(2), tokens, "{w}x{h}");
        }
        assert_eq!(probe(&png(64, 64), &input(), &l, "p", 1).unwrap(), 4);
    }

    #[test]
    fn pixel_bombs_and_garbage_are_refused_from_the_header() {
        let l = ImageLimits { max_pixels: 10_000, ..ImageLimits::default() };
        let e = probe(&png(200, 100), &input(), &l, "p", 2).unwrap_err();
        assert_eq!(e.code, Some("image_too_large"));
        assert!(e.message.contains("200x100") && e.message.contains("--max-image-pixels"), "{}", e.message);
        // A PNG header declaring 100000 x 100000 pixels, with no data: refused without decoding.
        let mut bomb = png(1, 1);
        bomb[16..20].copy_from_slice(&100_000u32.to_be_bytes());
        bomb[20..24].copy_from_slice(&100_000u32.to_be_bytes());
        let crc = bomb[12..29].iter().fold(!0u32, |c, &x| {
            (0..8).fold(c ^ x as u32, |c, _| if c & 1 == 1 { (c >> 1) ^ 0xedb8_8320 } else { c >> 1 })
        });
        bomb[29..33].copy_from_slice(&(!crc).to_be_bytes());
        let e = probe(&bomb, &input(), &ImageLimits::default(), "p", 1).unwrap_err();
        assert!(e.message.contains("100000x100000"), "{}", e.message);
        for junk in [&b"not an image at all"[..], b"GIF89a\x01\x00\x01\x00", &png(8, 8)[..20]] {
            let e = probe(junk, &input(), &l, "p", 1).unwrap_err();
            assert_eq!(e.status, 400, "{}", e.message);
        }
        // Extreme aspect ratios: the processor's own limit.
        let e = probe(&png(5000, 2), &input(), &ImageLimits::default(), "p", 1).unwrap_err();
        assert!(e.message.contains("aspect ratio"), "{}", e.message);
        // A truncated image: the header reads, the decode fails with a 400.
        let full = png(64, 64);
        let cut = full[..full.len() / 2].to_vec();
        let tokens = probe(&cut, &input(), &l, "p", 1).unwrap();
        let e = decode(&ImageBytes { bytes: cut, param: "p".into(), ordinal: 1, tokens }, &input(), &l).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("cannot be decoded"), "{}", e.message);
    }

    #[test]
    fn pads_expand_in_order() {
        let img = |tokens| ImageBytes { bytes: vec![], param: "p".into(), ordinal: 1, tokens };
        let out = expand(vec![1, 9, 2, 9, 3], 9, &[img(3), img(1)], "m").unwrap();
        assert_eq!(out, vec![1, 9, 9, 9, 2, 9, 3]);
        assert!(expand(vec![1, 9, 9], 9, &[img(2)], "m").is_err());
        assert!(expand(vec![1, 2], 9, &[img(2)], "m").is_err());
        assert_eq!(expand(vec![1, 2], 9, &[], "m").unwrap(), vec![1, 2]);
    }

    #[test]
    fn hash_is_fixed() {
        assert_eq!(hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(hash(&png(4, 4)), hash(&png(4, 5)));
    }
}
