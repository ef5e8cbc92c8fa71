// SPDX-License-Identifier: GPL-2.0
/*
 * bunshin_share - share a process's anonymous pages copy-on-write with another
 * process, the way fork() shares them with a child.
 *
 * Design (see README.md for the full discussion):
 *
 *  An anonymous page carries a pointer to an anon_vma; reverse mapping
 *  (reclaim, migration, KSM, THP split, page_referenced) finds every PTE that
 *  maps the page by walking the VMAs linked to that anon_vma.  Putting S's page
 *  into an arbitrary VMA of D would therefore make the page's rmap incomplete.
 *  Instead we make D's VMA a fork child of S's VMA in the anon_vma hierarchy
 *  (anon_vma_fork(), exactly what dup_mmap() does for a child) and then let the
 *  kernel's own fork page-table copier (copy_page_range()) install the pages:
 *  it takes the page references, duplicates the anon rmap
 *  (page_try_dup_anon_rmap), write-protects both sides, copies pages that may be
 *  DMA-pinned, duplicates swap entries, shares THPs as huge PMDs and copies the
 *  RSS counters.  D therefore ends up in the state a fork child is in: exact
 *  anonymous-memory semantics with no special casing anywhere else.
 *
 *  Neither anon_vma_fork() nor copy_page_range() is exported; they (and a few
 *  more) are resolved through kallsyms at load time.  That ties the module to
 *  the kernel series it was written against (6.1): module load refuses when a
 *  symbol is missing.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/module.h>
#include <linux/miscdevice.h>
#include <linux/fs.h>
#include <linux/mm.h>
#include <linux/mman.h>
#include <linux/mmap_lock.h>
#include <linux/rmap.h>
#include <linux/huge_mm.h>
#include <linux/sched/mm.h>
#include <linux/sched/task.h>
#include <linux/ptrace.h>
#include <linux/kprobes.h>
#include <linux/pid.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/version.h>
#include <asm/tlbflush.h>

#include "bunshin_share.h"

#if LINUX_VERSION_CODE < KERNEL_VERSION(6, 1, 0) || LINUX_VERSION_CODE >= KERNEL_VERSION(6, 2, 0)
#error "bunshin_share uses mm internals of Linux 6.1 (copy_page_range/anon_vma_fork signatures); port it first"
#endif

/* Unexported kernel functions, resolved at load time. */
static struct {
	int (*copy_page_range)(struct vm_area_struct *dst_vma,
			       struct vm_area_struct *src_vma);
	int (*anon_vma_fork)(struct vm_area_struct *vma,
			     struct vm_area_struct *pvma);
	struct task_struct *(*pidfd_get_task)(int pidfd, unsigned int *flags);
	struct mm_struct *(*mm_access)(struct task_struct *task,
				       unsigned int mode);
	void (*split_huge_pmd_address)(struct vm_area_struct *vma,
				       unsigned long address, bool freeze,
				       struct folio *folio);
	void (*flush_tlb_mm_range)(struct mm_struct *mm, unsigned long start,
				   unsigned long end, unsigned int stride_shift,
				   bool freed_tables);
	int (*__ksm_enter)(struct mm_struct *mm);
} kf;

static unsigned long (*bsh_kallsyms_lookup_name)(const char *name);

static int bsh_resolve(void)
{
	struct kprobe kp = { .symbol_name = "kallsyms_lookup_name" };
	int ret;

	ret = register_kprobe(&kp);
	if (ret < 0) {
		pr_err("cannot locate kallsyms_lookup_name (kprobes: %d)\n", ret);
		return ret;
	}
	bsh_kallsyms_lookup_name = (void *)kp.addr;
	unregister_kprobe(&kp);
	if (!bsh_kallsyms_lookup_name)
		return -ENOENT;

#define RESOLVE(name) do {						\
		unsigned long a = bsh_kallsyms_lookup_name(#name);	\
		if (!a) {						\
			pr_err("kernel symbol %s not found\n", #name);	\
			return -ENOENT;					\
		}							\
		*(unsigned long *)&kf.name = a;				\
	} while (0)
	RESOLVE(copy_page_range);
	RESOLVE(anon_vma_fork);
	RESOLVE(pidfd_get_task);
	RESOLVE(mm_access);
	RESOLVE(split_huge_pmd_address);
	RESOLVE(flush_tlb_mm_range);
	RESOLVE(__ksm_enter);
#undef RESOLVE
	return 0;
}

/* Mapping kinds refused with EOPNOTSUPP (besides any non-anonymous VMA). */
#define BSH_REFUSED_FLAGS (VM_SHARED | VM_MAYSHARE | VM_LOCKED | VM_LOCKONFAULT | \
			   VM_SPECIAL | VM_HUGETLB)

/*
 * [start, end) must lie inside one VMA.  -ENOMEM when part of it is not
 * mapped at all (as mprotect/madvise report), -EINVAL when it is mapped but
 * spans more than one VMA.
 */
static int bsh_find_vma(struct mm_struct *mm, unsigned long start,
			unsigned long end, struct vm_area_struct **out)
{
	struct vm_area_struct *vma = find_vma(mm, start);
	unsigned long addr;

	if (!vma || vma->vm_start > start)
		return -ENOMEM;
	if (end <= vma->vm_end) {
		*out = vma;
		return 0;
	}
	addr = vma->vm_end;
	while (addr < end) {
		struct vm_area_struct *next = find_vma(mm, addr);

		if (!next || next->vm_start > addr)
			return -ENOMEM;
		addr = next->vm_end;
	}
	return -EINVAL;
}

static int bsh_check_kind(struct vm_area_struct *vma)
{
	if (!vma_is_anonymous(vma) || (vma->vm_flags & BSH_REFUSED_FLAGS))
		return -EOPNOTSUPP;
	return 0;
}

/* Is every anon_vma that S's VMA is linked to also linked to D's VMA? */
static bool bsh_chain_covers(struct vm_area_struct *dst,
			     struct vm_area_struct *src)
{
	struct anon_vma_chain *s, *d;

	list_for_each_entry(s, &src->anon_vma_chain, same_vma) {
		bool found = false;

		list_for_each_entry(d, &dst->anon_vma_chain, same_vma) {
			if (d->anon_vma == s->anon_vma) {
				found = true;
				break;
			}
		}
		if (!found)
			return false;
	}
	return true;
}

static int bsh_lock_two(struct mm_struct *a, struct mm_struct *b)
{
	if (a > b)
		swap(a, b);
	if (mmap_write_lock_killable(a))
		return -EINTR;
	if (down_write_killable_nested(&b->mmap_lock, SINGLE_DEPTH_NESTING)) {
		mmap_write_unlock(a);
		return -EINTR;
	}
	return 0;
}

static void bsh_unlock_two(struct mm_struct *a, struct mm_struct *b)
{
	mmap_write_unlock(a);
	mmap_write_unlock(b);
}

static struct task_struct *bsh_get_task(int pidfd)
{
	unsigned int f_flags;

	if (pidfd == -1) {
		get_task_struct(current);
		return current;
	}
	if (pidfd < 0)
		return ERR_PTR(-EBADF);
	return kf.pidfd_get_task(pidfd, &f_flags);
}

static struct mm_struct *bsh_get_mm(struct task_struct *task)
{
	struct mm_struct *mm = kf.mm_access(task, PTRACE_MODE_ATTACH_REALCREDS);

	if (!mm)	/* kernel thread */
		return ERR_PTR(-ESRCH);
	return mm;
}

/*
 * mm counter including the calling task's not yet synced share of it
 * (SPLIT_RSS_COUNTING): copy_page_range() syncs current's cache into the mm
 * when D is the caller, which must not show up as pages shared.
 */
static unsigned long bsh_counter(struct mm_struct *mm, int member)
{
	long v = get_mm_counter(mm, member);

#ifdef SPLIT_RSS_COUNTING
	if (current->mm == mm)
		v += current->rss_stat.count[member];
#endif
	return v;
}

static long bsh_share(struct bunshin_share_req *req)
{
	unsigned long start = req->start, len = req->length, end = start + len;
	struct task_struct *src_task = NULL, *dst_task = NULL;
	struct mm_struct *src_mm = NULL, *dst_mm = NULL;
	struct vm_area_struct *svma, *dvma, *tmp = NULL;
	unsigned long s_lin, d_lin, anon0, swap0;
	long ret;

	if (req->flags || req->reserved[0] || req->reserved[1])
		return -EINVAL;
	if (!len || !PAGE_ALIGNED(start) || !PAGE_ALIGNED(len) ||
	    end < start || end > TASK_SIZE_MAX)
		return -EINVAL;

	src_task = bsh_get_task(req->src_pidfd);
	if (IS_ERR(src_task))
		return PTR_ERR(src_task);
	dst_task = bsh_get_task(req->dst_pidfd);
	if (IS_ERR(dst_task)) {
		ret = PTR_ERR(dst_task);
		dst_task = NULL;
		goto out;
	}
	src_mm = bsh_get_mm(src_task);
	if (IS_ERR(src_mm)) {
		ret = PTR_ERR(src_mm);
		src_mm = NULL;
		goto out;
	}
	dst_mm = bsh_get_mm(dst_task);
	if (IS_ERR(dst_mm)) {
		ret = PTR_ERR(dst_mm);
		dst_mm = NULL;
		goto out;
	}
	if (src_mm == dst_mm) {
		ret = -EINVAL;
		goto out;
	}
	tmp = kmalloc(sizeof(*tmp), GFP_KERNEL);
	if (!tmp) {
		ret = -ENOMEM;
		goto out;
	}

	ret = bsh_lock_two(src_mm, dst_mm);
	if (ret)
		goto out;

	ret = bsh_find_vma(src_mm, start, end, &svma);
	if (ret)
		goto unlock;
	ret = bsh_find_vma(dst_mm, start, end, &dvma);
	if (ret)
		goto unlock;
	ret = bsh_check_kind(svma);
	if (!ret)
		ret = bsh_check_kind(dvma);
	if (ret)
		goto unlock;
	/* Same protections: the PTEs copied from S carry S's protection bits. */
	if (((svma->vm_flags ^ dvma->vm_flags) & (VM_READ | VM_WRITE | VM_EXEC)) ||
	    pgprot_val(svma->vm_page_prot) != pgprot_val(dvma->vm_page_prot)) {
		ret = -EINVAL;
		goto unlock;
	}

	/*
	 * rmap computes a page's address in a VMA from page->index and
	 * vm_pgoff: the linear page index of an address must be the same in
	 * both VMAs (true for a fork child).
	 */
	s_lin = svma->vm_pgoff + ((start - svma->vm_start) >> PAGE_SHIFT);
	d_lin = dvma->vm_pgoff + ((start - dvma->vm_start) >> PAGE_SHIFT);
	if (dvma->anon_vma) {
		/*
		 * D's VMA already has anonymous memory: only acceptable when it
		 * is already linked to every anon_vma of S's VMA (a previous
		 * share from the same source VMA, or a real fork child).
		 */
		if (!svma->anon_vma || !bsh_chain_covers(dvma, svma)) {
			ret = -EBUSY;
			goto unlock;
		}
		if (s_lin != d_lin) {
			ret = -EINVAL;
			goto unlock;
		}
	} else if (s_lin != d_lin) {
		/* No anon_vma yet: nothing indexes this VMA by pgoff. */
		dvma->vm_pgoff = s_lin - ((start - dvma->vm_start) >> PAGE_SHIFT);
	}

	/*
	 * Drop whatever D maps in the range: with no anon_vma that can only be
	 * the shared zero page (4K or huge), otherwise D's own pages, which the
	 * caller asked to replace.  copy_page_range() expects empty
	 * destination page tables, as in a new child.
	 */
	zap_page_range(dvma, start, len);

	ret = 0;
	req->pages_mapped = 0;
	req->swap_shared = 0;
	if (!svma->anon_vma)	/* S never had anonymous pages here: all zero */
		goto unlock;

	/*
	 * A THP of S that straddles the range boundary must be split first:
	 * copy_page_range() copies whole huge PMDs.
	 */
	if (!IS_ALIGNED(start, HPAGE_PMD_SIZE) && start > svma->vm_start)
		kf.split_huge_pmd_address(svma, start, false, NULL);
	if (!IS_ALIGNED(end, HPAGE_PMD_SIZE) && end < svma->vm_end)
		kf.split_huge_pmd_address(svma, end, false, NULL);

	/*
	 * KSM pages: as fork does (vm_area_dup + ksm_fork), D's VMA becomes
	 * mergeable and D's mm is registered with ksmd, so that ksmd gives D's
	 * mappings of stable pages their own rmap_items (until then
	 * rmap_walk_ksm finds them through S's anon_vma, as for a new child).
	 */
	if ((svma->vm_flags & VM_MERGEABLE) && !(dvma->vm_flags & VM_MERGEABLE)) {
		if (!test_bit(MMF_VM_MERGEABLE, &dst_mm->flags)) {
			ret = kf.__ksm_enter(dst_mm);
			if (ret)
				goto unlock;
		}
		dvma->vm_flags |= VM_MERGEABLE;
	}

	if (!dvma->anon_vma) {
		ret = kf.anon_vma_fork(dvma, svma);
		if (ret) {
			ret = -ENOMEM;
			goto unlock;
		}
	}

	/*
	 * copy_page_range() walks src_vma->vm_start..vm_end: hand it a private
	 * copy of S's VMA narrowed to the requested range.  It only reads the
	 * copy (mm, flags, anon_vma, policy, ops), never links it anywhere.
	 */
	*tmp = *svma;
	tmp->vm_start = start;
	tmp->vm_end = end;

	anon0 = bsh_counter(dst_mm, MM_ANONPAGES);
	swap0 = bsh_counter(dst_mm, MM_SWAPENTS);
	ret = kf.copy_page_range(dvma, tmp);
	/* S's PTEs lost their write bit: as dup_mmap() does, flush S's TLB. */
	kf.flush_tlb_mm_range(src_mm, start, end, PAGE_SHIFT, false);
	if (ret) {
		/* Partial copy: leave D's range empty (zeros), report. */
		zap_page_range(dvma, start, len);
		ret = -ENOMEM;
		goto unlock;
	}
	req->pages_mapped = bsh_counter(dst_mm, MM_ANONPAGES) - anon0;
	req->swap_shared = bsh_counter(dst_mm, MM_SWAPENTS) - swap0;

unlock:
	bsh_unlock_two(src_mm, dst_mm);
out:
	kfree(tmp);
	if (dst_mm)
		mmput(dst_mm);
	if (src_mm)
		mmput(src_mm);
	if (dst_task)
		put_task_struct(dst_task);
	put_task_struct(src_task);
	return ret;
}

static long bsh_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct bunshin_share_req req;
	long ret;

	switch (cmd) {
	case BUNSHIN_SHARE_IOC_VERSION:
		return BUNSHIN_SHARE_API;
	case BUNSHIN_SHARE_IOC_SHARE:
		if (copy_from_user(&req, (void __user *)arg, sizeof(req)))
			return -EFAULT;
		ret = bsh_share(&req);
		if (ret)
			return ret;
		if (copy_to_user((void __user *)arg, &req, sizeof(req)))
			return -EFAULT;
		return 0;
	default:
		return -ENOTTY;
	}
}

static const struct file_operations bsh_fops = {
	.owner = THIS_MODULE,
	.unlocked_ioctl = bsh_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
};

static struct miscdevice bsh_dev = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "bunshin_share",
	.fops = &bsh_fops,
	.mode = 0600,
};

static int __init bsh_init(void)
{
	int ret = bsh_resolve();

	if (ret)
		return ret;
	ret = misc_register(&bsh_dev);
	if (ret)
		return ret;
	pr_info("ready (/dev/%s, api %d)\n", bsh_dev.name, BUNSHIN_SHARE_API);
	return 0;
}

static void __exit bsh_exit(void)
{
	misc_deregister(&bsh_dev);
}

module_init(bsh_init);
module_exit(bsh_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("Copy-on-write sharing of anonymous pages between processes");
MODULE_AUTHOR("bunshin-gym");
