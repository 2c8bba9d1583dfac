//! Images in requests: the image parts of every API (OpenAI chat `image_url`, Responses `input_image`, Anthropic
//! `image` blocks, which the front ends write as chat `image_url` parts) read into bytes, bounded, measured from
//! their headers and decoded into the tower's [`Pixels`].
//!
//! Images come inline as `data:` URLs with base64 PNG or JPEG; http(s) URLs are refused (tern fetches nothing).
//! Every bound is a 400 naming it: images per request ([`ImageLimits::max_images`]), bytes per image
//! ([`ImageLimits::max_bytes`], checked before the base64 is decoded) and pixels per image
//! ([`ImageLimits::max_pixels`], read from the image's header before anything is decoded, and enforced again by the
//! decoder's own limits, so that a small file declaring a huge image, a decompression bomb, costs nothing). All of
//! it runs on the preparation pool ([`crate::prep`]), never on the async workers.

use std::io::Cursor;
use std::sync::Arc;

use base64::Engine as _;
use tern_engine::model::ImageInput;
use tern_engine::Image;
use tern_model::vision::Pixels;

use crate::api::{clip, ApiError};

/// The bounds on a request's images (`--max-images`, `--max-image-bytes`, `--max-image-pixels`).
#[derive(Clone, Copy, Debug)]
pub struct ImageLimits {
    /// Images in one request, all messages together.
    pub max_images: usize,
    /// Bytes of one image file (decoded from its base64).
    pub max_bytes: usize,
    /// Pixels (width × height) of one image as stored, before the processor resizes it.
    pub max_pixels: u64,
}

impl Default for ImageLimits {
    /// 32 images, 8 MiB each (the default body cap allows 6 MiB of base64-encoded image), 25 megapixels each (a
    /// 6K screenshot; its RGBA decode takes 100 MB).
    fn default() -> ImageLimits {
        ImageLimits { max_images: 32, max_bytes: 8 << 20, max_pixels: 25_000_000 }
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

/// The bytes of an image part's URL: a `data:` URL with base64 content (http(s) URLs are refused), at most
/// `limits.max_bytes` once decoded (checked before decoding).
pub(crate) fn from_url(url: &str, param: &str, ordinal: usize, limits: &ImageLimits) -> Result<Vec<u8>, ApiError> {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https:/") {
        return Err(invalid(
            param,
            format!(
                "image {ordinal}: image URLs are not fetched by this server ('{}'); send the image inline as a data: \
                 URL (data:image/png;base64,...)",
                clip(url)
            ),
        ));
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
        assert_eq!(from_url(&url, "p", 1, &l).unwrap(), bytes);
        // Padding optional, media type by content.
        let bare = format!("data:;base64,{}", b64(&bytes).trim_end_matches('='));
        assert_eq!(from_url(&bare, "p", 1, &l).unwrap(), bytes);
        for (url, want) in [
            ("https://example.com/cat.png", "not fetched"),
            ("HTTP://example.com/cat.png", "not fetched"),
            ("file:///etc/passwd", "expected a data: URL"),
            ("data:image/png,abc", "must be base64"),
            ("data:image/png;base64", "needs a ','"),
            ("data:image/png;base64,***", "not valid base64"),
            ("data:image/gif;base64,R0lG", "'image/gif' is not supported"),
        ] {
            let e = from_url(url, "p", 3, &l).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.contains(want), "{url}: {}", e.message);
            assert!(e.message.starts_with("image 3"), "{}", e.message);
        }
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
