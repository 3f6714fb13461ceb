// File metadata (user.e2b.* xattrs) and /proc/sys/kernel/random/boot_id through the official npm
// `e2b` SDK (issue 14 item 8; the Python side is tests/e2e/test_e2e_guest_os.py). Run by
// tests/e2e/test_e2e_guest_os.py with E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL set; by hand:
//   E2B_API_KEY=... E2B_API_URL=http://127.0.0.1:PORT E2B_SANDBOX_URL=http://127.0.0.1:PORT \
//     node --test tests/js/guest_os.test.mjs
import { test } from 'node:test'
import assert from 'node:assert/strict'

import { Sandbox, InvalidArgumentError } from 'e2b'

for (const name of ['E2B_API_KEY', 'E2B_API_URL', 'E2B_SANDBOX_URL']) {
  if (!process.env[name]) {
    throw new Error(`${name} must be set (see the comment at the top of this file)`)
  }
}

const OPTS = { timeoutMs: 600_000, metadata: { suite: 'js-guest-os' } }
const BOOT_ID = /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/

async function sh(sbx, cmd) {
  return (await sbx.commands.run(cmd, { timeoutMs: 120_000 })).stdout.trim()
}

async function killAll(sandboxes) {
  for (const s of sandboxes) {
    try { await s.kill() } catch { /* cleanup */ }
  }
}

test('JS SDK: file metadata as user xattrs on tmpfs; refused with a reason on the root fs', { timeout: 300_000 }, async () => {
  const sbx = await Sandbox.create(OPTS)
  try {
    const f = '/dev/shm/meta-js.txt'
    const info = await sbx.files.write(f, 'payload', { metadata: { Origin: 'js', run: '7' } })
    assert.deepEqual(info.metadata, { origin: 'js', run: '7' })
    assert.deepEqual((await sbx.files.getInfo(f)).metadata, { origin: 'js', run: '7' })
    const listed = (await sbx.files.list('/dev/shm')).find((e) => e.name === 'meta-js.txt')
    assert.deepEqual(listed.metadata, { origin: 'js', run: '7' })
    assert.equal(await sh(sbx, `python3 -c "import os; print(os.getxattr('${f}', 'user.e2b.origin').decode())"`), 'js')
    await sbx.files.write(f, 'v2', { metadata: { only: 'this' } })
    assert.deepEqual((await sbx.files.getInfo(f)).metadata, { only: 'this' })

    // The root filesystem: runsc 20240729's gofer stores no user xattrs; the upload is refused before
    // it writes a byte (a runsc that can store them gets the metadata instead).
    const probe = await sh(sbx, "python3 -c \"import os; p = '/home/user/.probe'; open(p, 'w').close()\n" +
      "try:\n    os.setxattr(p, 'user.e2b.p', b'1'); print('yes')\nexcept OSError as e:\n    print('no', e.errno)\"")
    await sbx.files.write('/home/user/kept.txt', 'original')
    if (probe === 'yes') {
      const w = await sbx.files.write('/home/user/kept.txt', 'new', { metadata: { k: 'v' } })
      assert.deepEqual(w.metadata, { k: 'v' })
    } else {
      assert.equal(probe, 'no 95')
      await assert.rejects(sbx.files.write('/home/user/kept.txt', 'new', { metadata: { k: 'v' } }),
        (e) => e instanceof InvalidArgumentError && /no user extended attributes/.test(e.message))
      assert.equal(await sbx.files.read('/home/user/kept.txt'), 'original')
    }
  } finally {
    await killAll([sbx])
  }
})

test('JS SDK: boot_id is a stable v4 UUID per sandbox, kept by pause/resume and fork', { timeout: 400_000 }, async () => {
  const sbx = await Sandbox.create(OPTS)
  const other = await Sandbox.create(OPTS)
  const created = [sbx, other]
  try {
    const boot = await sh(sbx, 'cat /proc/sys/kernel/random/boot_id')
    assert.match(boot, BOOT_ID)
    assert.equal(await sh(sbx, 'cat /proc/sys/kernel/random/boot_id'), boot)
    assert.notEqual(await sh(other, 'cat /proc/sys/kernel/random/boot_id'), boot)
    assert.equal(await sbx.pause(), true)
    const resumed = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 600_000 })
    assert.equal(await sh(resumed, 'cat /proc/sys/kernel/random/boot_id'), boot)
  } finally {
    await killAll(created)
  }
})
