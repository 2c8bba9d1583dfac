//! Sequence state in one pool of pages (issue 12 item 3): the KV caches and the Gated DeltaNet states of every
//! sequence, running or kept by the prefix cache, live in fixed-size physical pages from one [`PagePool`] whose size
//! is set at start.
//!
//! # How
//!
//! Each sequence reserves its own range of virtual addresses (`cuMemAddressReserve`, [`SeqMem`]) laid out as a
//! sequence's state always was ([`Layout`]): the conv rings and recurrent states of the GDN layers, then K and V
//! of every attention layer for the full context. Only what holds state is backed by physical memory, mapped at
//! its offset (`cuMemMap`): a GDN *slot* (one allocation for all GDN layers' state, 64 MiB on the full model) and
//! K/V *pages* of the driver's granularity (2 MiB on H100/H200: 2,048 positions of one layer's K or V). The
//! kernels see the same contiguous buffers as before, at addresses fixed for the sequence's life, so the batch-1
//! CUDA graph and the batched pass's pointer tables need no page table (the idea of vAttention, Prabhu et al.
//! 2024, in place of PagedAttention's indirection).
//!
//! # Invariants
//!
//! * **Room is taken at alloc.** A sequence maps, when it is made, every page its reservation (prompt +
//!   completion, [`Layout::pages_for`]) needs; a step never maps memory and never runs out. No room in the pool is
//!   [`PoolFull`], an answer the engine turns into waiting or a refusal.
//! * **Full pages are shared, never written.** A fork maps the source's full KV pages (every position in them
//!   below the source's length) into its own range, counted once more; a sequence only appends, so nothing writes
//!   them again. The partly filled page of each KV region and the GDN state (always rewritten) are copied into
//!   fresh pages. A prefix-cache snapshot so costs its 67 MB of recurrent state and one page per K/V region.
//! * **A freed range is parked, not unmapped.** Dropping a [`SeqMem`] unmaps only the K/V pages another range
//!   maps too (after the stream is idle: no kernel or copy may still read them) and keeps the rest mapped
//!   ([`Parked`]): the next sequence of the same layout takes it as it is (mapping a new one costs ~95 driver
//!   calls, 0.64 ms on the H200; a parked one 0.05 ms). Parked pages count as used until the pool needs them: a
//!   sequence that finds too little room releases parked ranges first. An allocation returns to its free list
//!   when no range maps it; the pool keeps its physical memory until it is dropped (after every sequence: each
//!   holds an `Arc` of it).
//! * **A new sequence's recurrent state is zero**; its K/V pages hold zeros or an earlier sequence's rows, which
//!   no kernel reads (attention reads positions below the length only).

use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{ensure, Context, Result};
use cudarc::driver::{sys, CudaContext, CudaStream, DriverError};

use crate::gpu::KArg;

/// The pool had fewer free pages than a sequence needs (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolFull {
    pub need: usize,
    pub free: usize,
}

impl fmt::Display for PoolFull {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the sequence-state pool is full: {:.1} MB needed, {:.1} MB free (--state-mib sizes it)",
            self.need as f64 / 1e6,
            self.free as f64 / 1e6
        )
    }
}

impl std::error::Error for PoolFull {}

/// Where a sequence's state lies in its address range (byte offsets), and how many pages each part takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Page bytes (the driver's allocation granularity).
    pub page: usize,
    /// Per GDN layer (in layer order): offsets of its conv ring and recurrent state (f32).
    pub gdn: Vec<(usize, usize)>,
    /// Pages of the GDN part (offset 0): all mapped at alloc.
    pub gdn_pages: usize,
    /// Per attention layer (in layer order): offsets of its K and V regions (bf16 rows of `row` bytes).
    pub kv: Vec<(usize, usize)>,
    /// Bytes of one K (or V) row: one position's kv heads.
    pub row: usize,
    /// Pages of one K (or V) region (the full context).
    pub region_pages: usize,
    /// Tokens each K/V region holds at most.
    pub capacity: usize,
}

impl Layout {
    /// `gdn_layers` layers of `ring` + `state` f32 each, `attn_layers` layers of K and V with `row` bytes a position,
    /// `capacity` positions; pages of `page` bytes.
    pub fn new(
        page: usize,
        gdn_layers: usize,
        (ring, state): (usize, usize),
        attn_layers: usize,
        row: usize,
        capacity: usize,
    ) -> Layout {
        let align = |b: usize| b.next_multiple_of(256);
        let mut off = 0;
        let mut gdn = Vec::with_capacity(gdn_layers);
        for _ in 0..gdn_layers {
            let r = off;
            off += align(ring * 4);
            gdn.push((r, off));
            off += align(state * 4);
        }
        let gdn_pages = off.div_ceil(page);
        let region_pages = (capacity * row).div_ceil(page).max(1);
        let mut at = gdn_pages * page;
        let kv = (0..attn_layers)
            .map(|_| {
                let k = at;
                at += 2 * region_pages * page;
                (k, k + region_pages * page)
            })
            .collect();
        Layout { page, gdn, gdn_pages, kv, row, region_pages, capacity }
    }

    /// Bytes of the whole address range.
    pub fn bytes(&self) -> usize {
        (self.gdn_pages + 2 * self.kv.len() * self.region_pages) * self.page
    }

    /// KV pages of one region that `tokens` positions need.
    pub fn region_pages_for(&self, tokens: usize) -> usize {
        (tokens.min(self.capacity) * self.row).div_ceil(self.page)
    }

    /// Pages a sequence with room for `tokens` maps in all.
    pub fn pages_for(&self, tokens: usize) -> usize {
        self.gdn_pages + 2 * self.kv.len() * self.region_pages_for(tokens)
    }

    /// KV pages of one region that lie wholly below `len` positions (a fork shares them).
    pub fn full_pages(&self, len: usize) -> usize {
        (len.min(self.capacity) * self.row) / self.page
    }

    /// Byte offset of K/V region `r` (K of attention layer r / 2 for even r, its V for odd r).
    fn region(&self, r: usize) -> usize {
        let (k, v) = self.kv[r / 2];
        if r % 2 == 0 {
            k
        } else {
            v
        }
    }
}

/// A buffer inside a sequence's mapped range: its device address and length in elements (what the kernels get in
/// place of a `CudaSlice`; valid while its [`SeqMem`] lives).
#[derive(Debug)]
pub struct StateBuf<T> {
    pub ptr: u64,
    pub len: usize,
    _t: PhantomData<T>,
}

impl<T> Clone for StateBuf<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for StateBuf<T> {}

impl<T> StateBuf<T> {
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

impl<T> KArg for StateBuf<T> {
    fn word(&self, _: &CudaStream) -> u64 {
        self.ptr
    }
}

struct Inner {
    /// Most pages in use at once (all sequences together; a GDN slot counts its pages).
    limit: usize,
    /// Pages in use now.
    used: usize,
    /// Pages of all the physical allocations the pool holds (in use or free).
    created: usize,
    /// Every physical allocation and its size in pages (a released one: size 0).
    handles: Vec<(sys::CUmemGenericAllocationHandle, usize)>,
    /// Mappings of each allocation (0: free).
    refs: Vec<u32>,
    /// Free allocations by size in pages.
    free: Vec<(usize, Vec<u32>)>,
}

impl Inner {
    fn free_of(&mut self, size: usize) -> &mut Vec<u32> {
        let i = match self.free.iter().position(|(s, _)| *s == size) {
            Some(i) => i,
            None => {
                self.free.push((size, Vec::new()));
                self.free.len() - 1
            }
        };
        &mut self.free[i].1
    }
}

/// The physical memory every sequence's state comes from (see the module documentation): KV pages of one
/// granule and GDN slots of a sequence's whole recurrent state (one allocation, one mapping), at most `limit`
/// pages of them in use at once. Allocations are created as they are first needed and kept (a freed one goes back
/// to the free list of its size; free ones of another size are released when a new one would pass the limit).
pub struct PagePool {
    ctx: Arc<CudaContext>,
    ordinal: i32,
    page: usize,
    inner: Mutex<Inner>,
    /// Ranges of freed sequences, still mapped (see [`Parked`]).
    parked: Mutex<Vec<Parked>>,
}

/// The address range of a freed sequence, kept with its GDN slot and its unshared K/V pages mapped so that the
/// next sequence of the same layout needs no driver calls (a new sequence maps ~50 allocations at ~20 us each, and
/// a free unmaps them); its pages count as used until the pool needs them ([`PagePool::make_room`]).
struct Parked {
    base: u64,
    layout: Layout,
    gdn: Option<u32>,
    kv: Vec<Vec<u32>>,
    stream: Arc<CudaStream>,
}

/// Parked ranges kept at most (their pages are reclaimed under pressure; this bounds the address space).
const MAX_PARKED: usize = 256;

fn prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct of integers and a null pointer; all-zero is its documented default.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    p.location = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal };
    p
}

fn oom(e: &DriverError) -> bool {
    e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
}

impl PagePool {
    /// A pool on `ctx`'s device with no pages yet and no limit (see [`PagePool::set_limit`]).
    pub fn new(ctx: Arc<CudaContext>) -> Result<PagePool> {
        let ordinal = ctx.ordinal() as i32;
        ctx.bind_to_thread()?;
        let mut page = 0usize;
        let p = prop(ordinal);
        // SAFETY: writes one usize; `p` is a valid allocation description for this device.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut page,
                &p,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
            .result()?
        };
        ensure!(page > 0 && page.is_power_of_two(), "allocation granularity {page}");
        let inner =
            Inner { limit: usize::MAX, used: 0, created: 0, handles: Vec::new(), refs: Vec::new(), free: Vec::new() };
        Ok(PagePool { ctx, ordinal, page, inner: Mutex::new(inner), parked: Mutex::new(Vec::new()) })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> usize {
        self.page
    }

    /// Use at most `bytes` of pages at once (rounded down to pages; pages already in use stay).
    pub fn set_limit(&self, bytes: usize) {
        self.lock().limit = bytes / self.page;
    }

    /// The limit in pages (`usize::MAX`: none).
    pub fn limit_pages(&self) -> usize {
        self.lock().limit
    }

    /// Pages mapped by some sequence now.
    pub fn used_pages(&self) -> usize {
        self.lock().used
    }

    /// Pages a new sequence could take now (the limit less the pages in use).
    pub fn free_pages(&self) -> usize {
        let i = self.lock();
        i.limit.saturating_sub(i.used)
    }

    /// [`PoolFull`] unless `pages` more fit under the limit now (a sequence checks its whole need first, so that
    /// the error says what it needs in all).
    fn check_room(&self, pages: usize) -> Result<()> {
        self.make_room(pages);
        let room = self.free_pages();
        if room < pages {
            return Err(PoolFull { need: pages * self.page, free: room * self.page }.into());
        }
        Ok(())
    }

    /// `n` allocations of `size` pages each, each mapped once from now on; [`PoolFull`] if the limit or the
    /// device has no room for them.
    fn take(&self, n: usize, size: usize) -> Result<Vec<u32>> {
        self.make_room(n * size);
        let mut i = self.lock();
        let room = i.limit.saturating_sub(i.used);
        let need = n * size;
        if room < need {
            return Err(PoolFull { need: need * self.page, free: room * self.page }.into());
        }
        let mut got = Vec::with_capacity(n);
        while got.len() < n {
            if let Some(id) = i.free_of(size).pop() {
                got.push(id);
                continue;
            }
            // a new allocation; first give back free ones of other sizes while it would pass the limit
            while i.created + size > i.limit {
                let Some(id) = i.free.iter_mut().find(|(s, f)| *s != size && !f.is_empty()).and_then(|(_, f)| f.pop())
                else {
                    break;
                };
                let (h, pages) = i.handles[id as usize];
                // SAFETY: a free allocation (no mapping); released once (its size is zeroed below).
                let _ = unsafe { sys::cuMemRelease(h) };
                i.handles[id as usize].1 = 0;
                i.created -= pages;
            }
            match self.create(size) {
                Ok(h) => {
                    i.handles.push((h, size));
                    i.refs.push(0);
                    i.created += size;
                    got.push((i.handles.len() - 1) as u32);
                }
                Err(e) => {
                    i.free_of(size).extend(got.iter().copied());
                    if e.downcast_ref::<DriverError>().is_some_and(oom) {
                        // the device has no memory for more: the pool holds what it could get
                        return Err(PoolFull { need: need * self.page, free: 0 }.into());
                    }
                    return Err(e);
                }
            }
        }
        for &id in &got {
            i.refs[id as usize] = 1;
        }
        i.used += need;
        Ok(got)
    }

    /// Release parked ranges (most recent first) until `pages` fit under the limit or none is left.
    fn make_room(&self, pages: usize) {
        while self.free_pages() < pages {
            let Some(p) = self.parked.lock().unwrap_or_else(|e| e.into_inner()).pop() else { return };
            self.release(p);
        }
    }

    /// Release every parked range (their allocations back to the free lists).
    pub fn release_parked(&self) {
        let parked = std::mem::take(&mut *self.parked.lock().unwrap_or_else(|e| e.into_inner()));
        for p in parked {
            self.release(p);
        }
    }

    /// Keep a freed sequence's range (or release it when MAX_PARKED are kept).
    fn park(&self, p: Parked) {
        let mut v = self.parked.lock().unwrap_or_else(|e| e.into_inner());
        if v.len() < MAX_PARKED {
            v.push(p);
        } else {
            drop(v);
            self.release(p);
        }
    }

    /// A parked range of `layout`: the one closest to `need` pages a region (at least that many if any has).
    fn unpark(&self, layout: &Layout, need: usize) -> Option<Parked> {
        let mut v = self.parked.lock().unwrap_or_else(|e| e.into_inner());
        let pages = |p: &Parked| p.kv.iter().map(Vec::len).min().unwrap_or(0);
        let fit = |p: &Parked| (pages(p) < need, pages(p).abs_diff(need));
        let i = (0..v.len()).filter(|&i| v[i].layout == *layout).min_by_key(|&i| fit(&v[i]))?;
        Some(v.swap_remove(i))
    }

    /// Unmap a parked range (after its stream is idle), give its allocations back, free its addresses.
    fn release(&self, p: Parked) {
        let _ = self.ctx.bind_to_thread();
        let _ = p.stream.synchronize();
        let page = p.layout.page;
        if let Some(id) = p.gdn {
            // SAFETY: the slot mapped at the range's offset 0; the stream is idle.
            let _ = unsafe { sys::cuMemUnmap(p.base, p.layout.gdn_pages * page) };
            self.put(id);
        }
        let mut kv = p.kv;
        for (r, ids) in kv.iter_mut().enumerate() {
            let _ = self.unmap_pages(p.base, &p.layout, r, ids, 0);
        }
        // SAFETY: the range reserved for the sequence, all of it unmapped now.
        let _ = unsafe { sys::cuMemAddressFree(p.base, p.layout.bytes()) };
    }

    /// Unmap pages `from..` of region `r` of the range at `base` (the last first) and give each back; `ids` (the
    /// region's pages) keeps those before `from`. The caller has made the range's stream idle.
    fn unmap_pages(&self, base: u64, layout: &Layout, r: usize, ids: &mut Vec<u32>, from: usize) -> Result<()> {
        let region = layout.region(r);
        while ids.len() > from {
            let k = ids.len() - 1;
            // SAFETY: page k of region r, mapped there; nothing reads through it (the stream is idle).
            unsafe { sys::cuMemUnmap(base + (region + k * layout.page) as u64, layout.page).result()? };
            if let Some(id) = ids.pop() {
                self.put(id);
            }
        }
        Ok(())
    }

    /// Mappings of allocation `id` now.
    fn refs(&self, id: u32) -> u32 {
        self.lock().refs.get(id as usize).copied().unwrap_or(0)
    }

    /// One physical allocation of `size` pages; when the device is out of memory, once more after the
    /// stream-ordered allocator has returned the memory it keeps (gpu.rs `keep_freed_memory`).
    fn create(&self, size: usize) -> Result<sys::CUmemGenericAllocationHandle> {
        self.ctx.bind_to_thread()?;
        let p = prop(self.ordinal);
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: writes one handle; `p` describes pinned device memory of this device; the size is a multiple of
        // the granularity the driver reported for it.
        let r = unsafe { sys::cuMemCreate(&mut h, size * self.page, &p, 0).result() };
        match r {
            Err(e) if oom(&e) => {
                trim_default_pool(self.ordinal)?;
                // SAFETY: as above.
                unsafe { sys::cuMemCreate(&mut h, size * self.page, &p, 0).result()? };
            }
            r => r?,
        }
        Ok(h)
    }

    /// The handle and size (bytes) of allocation `id`.
    fn handle(&self, id: u32) -> Result<(sys::CUmemGenericAllocationHandle, usize)> {
        let i = self.lock();
        let &(h, pages) = i.handles.get(id as usize).with_context(|| format!("no allocation {id} in the pool"))?;
        ensure!(pages > 0, "allocation {id} was released");
        Ok((h, pages * self.page))
    }

    /// Count one more mapping of allocation `id`.
    fn share(&self, id: u32) {
        if let Some(r) = self.lock().refs.get_mut(id as usize) {
            *r += 1;
        }
    }

    /// One mapping of allocation `id` fewer; free at zero.
    fn put(&self, id: u32) {
        let mut i = self.lock();
        let Some(&(_, size)) = i.handles.get(id as usize) else { return };
        if let Some(r) = i.refs.get_mut(id as usize) {
            *r = r.saturating_sub(1);
            if *r == 0 {
                i.used = i.used.saturating_sub(size);
                i.free_of(size).push(id);
            }
        }
    }
}

impl Drop for PagePool {
    fn drop(&mut self) {
        self.release_parked();
        let _ = self.ctx.bind_to_thread();
        for &(h, pages) in &self.lock().handles {
            if pages > 0 {
                // SAFETY: every sequence holds an Arc of the pool, so none maps anything any more; each live
                // handle is released once.
                let _ = unsafe { sys::cuMemRelease(h) };
            }
        }
    }
}

/// Give the default memory pool's unused memory back to the driver (so that `cuMemCreate` can have it).
fn trim_default_pool(ordinal: i32) -> Result<()> {
    let dev = cudarc::driver::result::device::get(ordinal)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: plain driver calls on a valid device; the pool handle is written, then trimmed to what is in use.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, dev).result()?;
        sys::cuMemPoolTrimTo(pool, 0).result()?;
    }
    Ok(())
}

/// One sequence's address range and what is mapped into it: its GDN slot at offset 0 and, per K/V region, the
/// pages from the region's start.
pub struct SeqMem {
    pool: Arc<PagePool>,
    stream: Arc<CudaStream>,
    pub layout: Layout,
    base: u64,
    gdn: Option<u32>,
    kv: Vec<Vec<u32>>,
}

impl SeqMem {
    /// A range laid out as `layout` with room for `tokens` positions: its GDN slot and first K/V pages mapped,
    /// zeroed.
    pub fn new(pool: &Arc<PagePool>, stream: &Arc<CudaStream>, layout: Layout, tokens: usize) -> Result<SeqMem> {
        let need = layout.region_pages_for(tokens);
        if let Some(m) = SeqMem::reuse(pool, stream, &layout, need)? {
            m.zero_gdn()?;
            return Ok(m);
        }
        pool.check_room(layout.pages_for(tokens))?;
        let mut m = SeqMem::reserve(pool, stream, layout)?;
        m.map_slot()?;
        m.zero(0, m.layout.gdn_pages * m.layout.page)?;
        for r in 0..m.kv.len() {
            m.map_fresh(r, need, true)?;
        }
        Ok(m)
    }

    /// A parked range of `layout` fitted to `need` pages a region (missing ones mapped, zeroed; extra ones
    /// unmapped) with its GDN slot (not zeroed); None when none is parked.
    fn reuse(pool: &Arc<PagePool>, stream: &Arc<CudaStream>, layout: &Layout, need: usize) -> Result<Option<SeqMem>> {
        let Some(p) = pool.unpark(layout, need) else { return Ok(None) };
        let mut m =
            SeqMem { pool: pool.clone(), stream: stream.clone(), layout: p.layout, base: p.base, gdn: p.gdn, kv: p.kv };
        if m.kv.iter().any(|k| k.len() > need) {
            m.stream.synchronize()?; // nothing may still touch the pages given back
            for r in 0..m.kv.len() {
                m.pool.unmap_pages(m.base, &m.layout, r, &mut m.kv[r], need)?;
            }
        }
        let short: usize = m.kv.iter().map(|k| need - k.len()).sum();
        pool.check_room(short + if m.gdn.is_none() { m.layout.gdn_pages } else { 0 })?;
        if m.gdn.is_none() {
            m.map_slot()?;
        }
        for r in 0..m.kv.len() {
            let n = need - m.kv[r].len();
            if n > 0 {
                m.map_fresh(r, n, true)?;
            }
        }
        Ok(Some(m))
    }

    /// A copy of `src` (which holds `len` positions) with room for `tokens` (at least `len`): its full K/V pages
    /// shared, its partly filled ones and its GDN slot copied into fresh memory (stream-ordered), the rest fresh.
    pub fn fork(src: &SeqMem, len: usize, tokens: usize) -> Result<SeqMem> {
        let l = &src.layout;
        let (full, need) = (l.full_pages(len), l.region_pages_for(tokens.max(len)));
        if full == 0 {
            // nothing to share: a parked range will do, the GDN slot and the partial pages copied
            if let Some(m) = SeqMem::reuse(&src.pool, &src.stream, l, need)? {
                let page = m.layout.page;
                let mut copies = vec![(0, m.layout.gdn_pages * page)];
                if len > 0 {
                    copies.extend((0..m.kv.len()).map(|r| (m.layout.region(r), page)));
                }
                m.copy_from(src, &copies)?;
                return Ok(m);
            }
        }
        src.pool.check_room(l.gdn_pages + 2 * l.kv.len() * (need - full))?;
        let mut m = SeqMem::reserve(&src.pool, &src.stream, src.layout.clone())?;
        let partial = m.layout.region_pages_for(len) > full;
        m.map_slot()?;
        let page = m.layout.page;
        let mut copies = vec![(0, m.layout.gdn_pages * page)];
        for r in 0..m.kv.len() {
            let shared = src.kv.get(r).and_then(|p| p.get(..full)).context("fork: the source lacks a full page")?;
            for &id in shared {
                m.pool.share(id);
                let off = m.layout.region(r) + m.kv[r].len() * page;
                if let Err(e) = m.map(off, page, id) {
                    m.pool.put(id);
                    return Err(e);
                }
                m.kv[r].push(id);
            }
            m.map_fresh(r, need - full, false)?;
            let off = m.layout.region(r) + full * page;
            if partial {
                copies.push((off, page));
                m.zero(off + page, (need - full - 1) * page)?;
            } else {
                m.zero(off, (need - full) * page)?;
            }
        }
        m.copy_from(src, &copies)?;
        Ok(m)
    }

    /// Copy each (offset, bytes) span of `src`'s range into this one (stream-ordered).
    fn copy_from(&self, src: &SeqMem, spans: &[(usize, usize)]) -> Result<()> {
        for &(off, bytes) in spans {
            // SAFETY: both ranges are mapped over [off, off + bytes) (the callers copy the GDN slot and partial pages
            // that the source holds and this range mapped); ordered on the one stream.
            unsafe {
                sys::cuMemcpyDtoDAsync_v2(self.base + off as u64, src.base + off as u64, bytes, self.stream.cu_stream())
                    .result()?
            };
        }
        Ok(())
    }

    fn reserve(pool: &Arc<PagePool>, stream: &Arc<CudaStream>, layout: Layout) -> Result<SeqMem> {
        ensure!(layout.page == pool.page, "layout pages {} != pool pages {}", layout.page, pool.page);
        pool.ctx.bind_to_thread()?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: writes one address; size and alignment are multiples of the granularity.
        unsafe { sys::cuMemAddressReserve(&mut base, layout.bytes(), layout.page, 0, 0).result()? };
        let kv = vec![Vec::new(); 2 * layout.kv.len()];
        Ok(SeqMem { pool: pool.clone(), stream: stream.clone(), layout, base, gdn: None, kv })
    }

    /// Map allocation `id` (`bytes`, its count already taken) at byte offset `off`.
    fn map(&mut self, off: usize, bytes: usize, id: u32) -> Result<()> {
        let (h, size) = self.pool.handle(id)?;
        ensure!(
            size == bytes && off % self.layout.page == 0 && off + bytes <= self.layout.bytes(),
            "map: {off}+{bytes}"
        );
        // SAFETY: a page-aligned span inside this range that nothing maps yet (the callers map each span once, in
        // order); `h` is a live allocation of exactly `bytes`.
        unsafe { sys::cuMemMap(self.base + off as u64, bytes, 0, h, 0).result()? };
        Ok(())
    }

    /// Let the device read and write the mapped span at `off`.
    fn allow(&self, off: usize, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.pool.ordinal,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the span is wholly mapped (by `map`); one access descriptor.
        unsafe { sys::cuMemSetAccess(self.base + off as u64, bytes, &access, 1).result()? };
        Ok(())
    }

    /// Take and map a GDN slot at offset 0.
    fn map_slot(&mut self) -> Result<()> {
        let bytes = self.layout.gdn_pages * self.layout.page;
        if bytes == 0 {
            return Ok(());
        }
        let id = self.pool.take(1, self.layout.gdn_pages)?[0];
        if let Err(e) = self.map(0, bytes, id) {
            self.pool.put(id);
            return Err(e);
        }
        self.gdn = Some(id);
        self.allow(0, bytes)
    }

    /// Take `n` fresh pages and map them after region `r`'s mapped ones, then allow access to the whole mapped run
    /// (zeroed with `zero`).
    fn map_fresh(&mut self, r: usize, n: usize, zero: bool) -> Result<()> {
        let page = self.layout.page;
        let start = self.layout.region(r) + self.kv[r].len() * page;
        let ids = self.pool.take(n, 1)?;
        for (k, &id) in ids.iter().enumerate() {
            let off = self.layout.region(r) + self.kv[r].len() * page;
            if let Err(e) = self.map(off, page, id) {
                ids[k..].iter().for_each(|&i| self.pool.put(i)); // not mapped: back now; the mapped ones at drop
                return Err(e);
            }
            self.kv[r].push(id);
        }
        let region = self.layout.region(r);
        self.allow(region, self.kv[r].len() * page)?;
        if zero {
            self.zero(start, n * page)?;
        }
        Ok(())
    }

    /// Zero `bytes` at `off` (stream-ordered; mapped memory).
    fn zero(&self, off: usize, bytes: usize) -> Result<()> {
        if bytes > 0 {
            // SAFETY: the callers pass spans they mapped read-write.
            unsafe { sys::cuMemsetD8Async(self.base + off as u64, 0, bytes, self.stream.cu_stream()).result()? };
        }
        Ok(())
    }

    /// Zero the GDN part (conv rings and recurrent states; stream-ordered).
    pub fn zero_gdn(&self) -> Result<()> {
        self.zero(0, if self.gdn.is_some() { self.layout.gdn_pages * self.layout.page } else { 0 })
    }

    /// Pages mapped into this range (the GDN slot counts its pages).
    pub fn mapped_pages(&self) -> usize {
        self.gdn.map_or(0, |_| self.layout.gdn_pages) + self.kv.iter().map(Vec::len).sum::<usize>()
    }

    /// Positions of each K/V region that are mapped (the room this sequence has).
    pub fn room(&self) -> usize {
        match self.kv.iter().map(Vec::len).min() {
            Some(p) => (p * self.layout.page / self.layout.row.max(1)).min(self.layout.capacity),
            None => self.layout.capacity,
        }
    }

    /// The buffer of `len` elements of `T` at byte offset `off`.
    pub fn buf<T>(&self, off: usize, len: usize) -> StateBuf<T> {
        StateBuf { ptr: self.base + off as u64, len, _t: PhantomData }
    }

    /// The page ids mapped in the first K region (tests: what a fork shares).
    pub fn first_region_pages(&self) -> Vec<u32> {
        self.kv.first().cloned().unwrap_or_default()
    }
}

impl Drop for SeqMem {
    /// Park the range for the next sequence ([`Parked`]), less the K/V pages another range maps too (from a
    /// region's first shared page on: a parked range keeps only pages nothing else reads).
    fn drop(&mut self) {
        let _ = self.pool.ctx.bind_to_thread();
        let mut synced = false;
        for r in 0..self.kv.len() {
            let Some(first) = self.kv[r].iter().position(|&id| self.pool.refs(id) > 1) else { continue };
            if !synced {
                let _ = self.stream.synchronize(); // no kernel or copy may still read through this range
                synced = true;
            }
            let _ = self.pool.unmap_pages(self.base, &self.layout, r, &mut self.kv[r], first);
        }
        let parked = Parked {
            base: self.base,
            layout: self.layout.clone(),
            gdn: self.gdn.take(),
            kv: std::mem::take(&mut self.kv),
            stream: self.stream.clone(),
        };
        self.pool.park(parked);
    }
}

impl<T> crate::gpu::DevBuf<T> for StateBuf<T> {
    fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The full shape: 30 GDN layers (ring 4 x 8192, state 32 x 128 x 128), 10 attention layers of 2 x 256 bf16
    /// rows, 2 MiB pages.
    fn full(capacity: usize) -> Layout {
        Layout::new(2 << 20, 30, (4 * 8192, 32 * 128 * 128), 10, 2 * 256 * 2, capacity)
    }

    #[test]
    fn layout_parts_do_not_overlap_and_fit_the_range() {
        for cap in [1, 100, 2048, 2049, 32768] {
            let l = full(cap);
            let mut parts: Vec<(usize, usize)> = Vec::new();
            for &(r, s) in &l.gdn {
                parts.push((r, r + 4 * 8192 * 4));
                parts.push((s, s + 32 * 128 * 128 * 4));
            }
            for &(k, v) in &l.kv {
                parts.push((k, k + cap * l.row));
                parts.push((v, v + cap * l.row));
            }
            parts.sort();
            for w in parts.windows(2) {
                assert!(w[0].1 <= w[1].0, "capacity {cap}: {:?} overlaps {:?}", w[0], w[1]);
            }
            assert!(parts.last().unwrap().1 <= l.bytes(), "capacity {cap}: past the range");
            assert!(l.gdn.last().unwrap().1 + 32 * 128 * 128 * 4 <= l.gdn_pages * l.page, "GDN part past its pages");
            assert_eq!(l.kv[0].0 % l.page, 0, "K regions start on a page");
        }
    }

    #[test]
    fn pages_follow_the_reservation() {
        let l = full(32768);
        // 2048 positions of 1 KB fill a 2 MiB page
        assert_eq!((l.region_pages_for(0), l.region_pages_for(1), l.region_pages_for(2048)), (0, 1, 1));
        assert_eq!((l.region_pages_for(2049), l.region_pages_for(32768), l.region_pages_for(99999)), (2, 16, 16));
        // recurrent state: 30 x (128 KiB ring + 2 MiB state) = 66.8 MB -> 32 pages
        assert_eq!(l.gdn_pages, 32);
        assert_eq!(l.pages_for(200), 32 + 20);
        assert_eq!(l.pages_for(32768), 32 + 20 * 16);
        // a fork of a 4,100-token sequence shares 2 full pages a region and copies the third
        assert_eq!((l.full_pages(4100), l.region_pages_for(4100)), (2, 3));
        assert_eq!((l.full_pages(4096), l.region_pages_for(4096)), (2, 2));
    }
}
