/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * bunshin_share: userspace API of the anonymous copy-on-write page sharing
 * module.  Device: /dev/bunshin_share (misc device, mode 0600).
 *
 * BUNSHIN_SHARE_IOC_SHARE maps the anonymous pages of [start, start+length)
 * of process S (src_pidfd) into the same range of process D (dst_pidfd, or
 * the calling process when dst_pidfd == -1), exactly as fork() would for a
 * child: both sides end up write-protected, the next write on either side
 * gets a private copy through the kernel's own copy-on-write fault.
 * See kmod/README.md for the contract and the errno list.
 */
#ifndef _UAPI_BUNSHIN_SHARE_H
#define _UAPI_BUNSHIN_SHARE_H

#include <linux/types.h>
#include <linux/ioctl.h>

#define BUNSHIN_SHARE_DEVICE	"/dev/bunshin_share"
#define BUNSHIN_SHARE_API	1

struct bunshin_share_req {
	__s32 src_pidfd;	/* in: pidfd of the source process S */
	__s32 dst_pidfd;	/* in: pidfd of the destination D, -1 = caller */
	__u64 start;		/* in: page aligned start address (same in S and D) */
	__u64 length;		/* in: page aligned length, > 0 */
	__u64 flags;		/* in: must be 0 */
	__u64 pages_mapped;	/* out: growth of D's resident anon pages (4 KiB units) */
	__u64 swap_shared;	/* out: swap entries of S duplicated into D */
	__u64 reserved[2];	/* in: must be 0 */
};

#define BUNSHIN_SHARE_IOC_MAGIC	0xB5
/* returns BUNSHIN_SHARE_API */
#define BUNSHIN_SHARE_IOC_VERSION	_IO(BUNSHIN_SHARE_IOC_MAGIC, 0)
#define BUNSHIN_SHARE_IOC_SHARE		_IOWR(BUNSHIN_SHARE_IOC_MAGIC, 1, struct bunshin_share_req)

#endif /* _UAPI_BUNSHIN_SHARE_H */
