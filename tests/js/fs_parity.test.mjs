// Filesystem parity with E2B's envd through the official JS SDK (issue 14 items 1, 4, 6); run by
// tests/e2e/test_e2e_fs_parity.py with E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL set.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'

import { Sandbox } from 'e2b'

const tag = () => randomBytes(6).toString('hex')
const sleep = (ms) => new Promise((res) => setTimeout(res, ms))
let sbx

before(async () => {
  sbx = await Sandbox.create({ metadata: { suite: 'js-fs-parity' }, timeoutMs: 240_000 })
})
after(async () => {
  if (sbx) await sbx.kill()
})

const typesOf = (events, name) => events.filter((e) => e.name === name).map((e) => e.type)

test('watch: files.write of a new file yields create, chmod, write (flat and recursive)', { timeout: 60_000 }, async () => {
  const d = `/home/user/watch-${tag()}`
  await sbx.files.makeDir(`${d}/sub`)
  const flat = []
  const deep = []
  const w1 = await sbx.files.watchDir(d, (e) => flat.push(e))
  const w2 = await sbx.files.watchDir(d, (e) => deep.push(e), { recursive: true })
  try {
    await sbx.files.write(`${d}/new.txt`, 'hello')
    await sbx.files.write(`${d}/sub/inner.txt`, 'world')
    await sbx.files.write(`${d}/made/x.txt`, 'x')
    for (let i = 0; i < 200 && !(typesOf(deep, 'sub/inner.txt').includes('write') && typesOf(deep, 'made').includes('chmod')
      && typesOf(flat, 'new.txt').includes('write')); i++) await sleep(100)
    await sleep(500)
    assert.deepEqual(typesOf(flat, 'new.txt'), ['create', 'chmod', 'write'], JSON.stringify(flat))
    assert.deepEqual(flat.filter((e) => e.name.startsWith('sub/')), [])
    assert.deepEqual(typesOf(deep, 'new.txt'), ['create', 'chmod', 'write'], JSON.stringify(deep))
    assert.deepEqual(typesOf(deep, 'sub/inner.txt'), ['create', 'chmod', 'write'], JSON.stringify(deep))
    assert.deepEqual(typesOf(deep, 'made'), ['create', 'chmod'], JSON.stringify(deep))
  } finally {
    await w1.stop()
    await w2.stop()
  }
})

test('symlinks: getInfo and list follow the link for type and mode', { timeout: 60_000 }, async () => {
  const d = `/home/user/links-${tag()}`
  await sbx.commands.run(`mkdir -p ${d}/dir && printf abc > ${d}/f.txt && chmod 640 ${d}/f.txt && chmod 750 ${d}/dir && `
    + `cd ${d} && ln -s f.txt to-file && ln -s dir to-dir && ln -s to-file chain && ln -s missing dangling`)
  const expected = {
    'to-file': ['file', `${d}/f.txt`, 0o640, 'f.txt'.length],
    'to-dir': ['dir', `${d}/dir`, 0o750, 'dir'.length],
    chain: ['file', `${d}/f.txt`, 0o640, 'to-file'.length],
    dangling: [undefined, `${d}/dangling`, 0, 'missing'.length],
  }
  const listed = Object.fromEntries((await sbx.files.list(d)).map((e) => [e.name, e]))
  // the SDK leaves entries of unknown type (the dangling link) out of a listing, as with E2B
  assert.deepEqual(Object.keys(listed).sort(), ['chain', 'dir', 'f.txt', 'to-dir', 'to-file'])
  for (const [name, [type, target, mode, size]] of Object.entries(expected)) {
    const infos = [await sbx.files.getInfo(`${d}/${name}`), ...(name in listed ? [listed[name]] : [])]
    for (const info of infos) {
      const got = { type: info.type, symlinkTarget: info.symlinkTarget, mode: info.mode, size: info.size,
        permissions: info.permissions, path: info.path, owner: info.owner }
      assert.deepEqual(got, { type, symlinkTarget: target, mode, size, permissions: 'Lrwxrwxrwx', path: `${d}/${name}`, owner: 'user' }, name)
    }
  }
  assert.equal(listed['f.txt'].type, 'file')
  assert.equal(listed['f.txt'].symlinkTarget, undefined)
})

test('write: missing directories outside the home are made for the user', { timeout: 60_000 }, async () => {
  const top = `/0-${tag()}`
  await sbx.files.write(`${top}/a/file.txt`, 'made for user')
  assert.equal(await sbx.files.read(`${top}/a/file.txt`), 'made for user')
  const st = async (p) => (await sbx.commands.run(`stat -c '%U:%G %a %F' ${p}`)).stdout.trim()
  assert.equal(await st(top), 'user:user 755 directory')
  assert.equal(await st(`${top}/a`), 'user:user 755 directory')
  assert.match(await st(`${top}/a/file.txt`), /^user:user /)
  assert.equal(await sbx.files.makeDir(`${top}-d/p`), true)
  assert.equal(await st(`${top}-d`), 'user:user 755 directory')
  const closed = `/root/${tag()}`
  await assert.rejects(sbx.files.write(`${closed}/x.txt`, 'no'))
  assert.equal((await sbx.commands.run(`test -e ${closed} || echo absent`, { user: 'root' })).stdout.trim(), 'absent')
  await sbx.commands.run(`rm -rf ${top} ${top}-d`, { user: 'root' })
})
