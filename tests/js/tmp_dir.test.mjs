// /tmp is a directory of the sandbox's disk, as in E2B (issue 14 item 7), through the official npm
// `e2b` SDK: permissions, pause/resume with and without memory, fork and a snapshot. Run by
// tests/e2e/test_e2e_tmp_dir.py with E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL set; by hand:
//   E2B_API_KEY=... E2B_API_URL=http://127.0.0.1:PORT E2B_SANDBOX_URL=http://127.0.0.1:PORT \
//     node --test tests/js/tmp_dir.test.mjs
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'

import { Sandbox } from 'e2b'

for (const name of ['E2B_API_KEY', 'E2B_API_URL', 'E2B_SANDBOX_URL']) {
  if (!process.env[name]) {
    throw new Error(`${name} must be set (see the comment at the top of this file)`)
  }
}

const OPTS = { timeoutMs: 600_000, metadata: { suite: 'js-tmp-dir' } }

async function sh(sbx, cmd, opts = {}) {
  return (await sbx.commands.run(cmd, { timeoutMs: 120_000, ...opts })).stdout
}

// Nothing mounted on /tmp, the same filesystem as /, 1777 root:root.
async function assertTmpOnDisk(sbx) {
  assert.equal(await sh(sbx, "awk '$5 == \"/tmp\"' /proc/self/mountinfo"), '', 'something is mounted on /tmp')
  const [root, tmp] = (await sh(sbx, 'stat -c %d / /tmp')).trim().split('\n')
  assert.equal(tmp, root, '/tmp is another filesystem than /')
  assert.equal((await sh(sbx, "stat -c '%a %U:%G' /tmp")).trim(), '1777 root:root')
}

async function killAll(sandboxes) {
  for (const s of sandboxes) {
    try { await s.kill() } catch { /* cleanup */ }
  }
}

test('JS SDK: /tmp is the disk, the user writes there, rename to $HOME works', { timeout: 300_000 }, async () => {
  const sbx = await Sandbox.create(OPTS)
  try {
    await assertTmpOnDisk(sbx)
    const tag = randomBytes(6).toString('hex')
    await sbx.files.write('/tmp/js/a.txt', tag)
    assert.equal((await sh(sbx, 'stat -c %U /tmp/js/a.txt')).trim(), 'user')
    await sh(sbx, "python3 -c \"import os; os.rename('/tmp/js/a.txt', '/home/user/js-a.txt')\"")
    assert.equal(await sbx.files.read('/home/user/js-a.txt'), tag)
    const names = (await sbx.files.list('/tmp')).map((e) => e.name)
    assert.ok(names.includes('js'), names.join(','))
  } finally {
    await killAll([sbx])
  }
})

test('JS SDK: /tmp survives pause/resume with memory and without', { timeout: 600_000 }, async () => {
  let sbx = await Sandbox.create(OPTS)
  const ids = [sbx]
  try {
    const tag = randomBytes(6).toString('hex')
    await sbx.files.write('/tmp/js/p.txt', tag)
    assert.equal(await sbx.pause(), true)
    sbx = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 600_000 })
    assert.equal(await sbx.files.read('/tmp/js/p.txt'), tag)
    await sh(sbx, 'echo second >> /tmp/js/p.txt')
    assert.equal(await sbx.pause({ keepMemory: false }), true)
    sbx = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 600_000 })
    ids.push(sbx)
    assert.equal(await sbx.files.read('/tmp/js/p.txt'), `${tag}second\n`)
    await assertTmpOnDisk(sbx)
  } finally {
    await killAll(ids)
  }
})

test('JS SDK: fork children and a snapshot carry /tmp; a child\'s writes stay its own', { timeout: 600_000 }, async () => {
  const src = await Sandbox.create(OPTS)
  const all = [src]
  let snapshotId
  try {
    await src.files.write('/tmp/js/f.txt', 'source')
    const children = await src.fork({ count: 2, timeoutMs: 600_000 })
    for (const c of children) {
      assert.ok(c instanceof Sandbox, String(c))
      all.push(c)
    }
    const [a, b] = children
    assert.equal(await a.files.read('/tmp/js/f.txt'), 'source')
    assert.equal(await b.files.read('/tmp/js/f.txt'), 'source')
    await a.files.write('/tmp/js/f.txt', 'changed in a')
    await a.files.write('/tmp/js/only-a.txt', 'a')
    assert.equal(await b.files.read('/tmp/js/f.txt'), 'source')
    assert.equal(await b.files.exists('/tmp/js/only-a.txt'), false)
    assert.equal(await src.files.read('/tmp/js/f.txt'), 'source')

    const snap = await src.createSnapshot()
    snapshotId = snap.snapshotId
    const fromSnap = await Sandbox.create(snapshotId, OPTS)
    all.push(fromSnap)
    assert.equal(await fromSnap.files.read('/tmp/js/f.txt'), 'source')
    await assertTmpOnDisk(fromSnap)
  } finally {
    await killAll(all)
    if (snapshotId) {
      try { await Sandbox.deleteSnapshot(snapshotId) } catch { /* cleanup */ }
    }
  }
})
