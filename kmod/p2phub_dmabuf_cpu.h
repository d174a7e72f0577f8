/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Between the dma-buf provider (p2phub_dmabuf.c: attachments, device maps,
 * revocation) and its CPU side (p2phub_dmabuf_cpu.c: the pages and mapping
 * of the exports' mmap). See struct p2phub_provider's cpu_pages and mmap.
 */
#ifndef _P2PHUB_DMABUF_CPU_H
#define _P2PHUB_DMABUF_CPU_H

#include <linux/types.h>

struct p2phub_reg;
struct page;
struct vm_area_struct;

int p2phub_dmabuf_cpu_pages(struct p2phub_reg *reg, struct page ***pages,
			    bool *wc);
int p2phub_dmabuf_mmap(struct p2phub_reg *reg, struct vm_area_struct *vma);
/* Drop the CPU map at release, once no export is mapped. */
void p2phub_dmabuf_cpu_release(struct p2phub_reg *reg);

#endif /* _P2PHUB_DMABUF_CPU_H */
