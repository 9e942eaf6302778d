"""Per-node identities: a run authority, certificates that name node ids, and revocation.

The run's operator holds a certificate authority (ECDSA P-256, made with ``cryptography``) in a
keys directory; every node and the coordinator get their own key and a certificate whose common
name is their identity (a node id, or ``coordinator``). Connections are mutual TLS 1.3 with
these certificates (:attr:`Credentials.server_context`, :attr:`Credentials.client_context`), so
every connection is bound to the identity at its other end, and everything on it is encrypted.

Keys directory (``python -m intellect_jax.keys`` manages it)::

    ca.crt  ca.key  crl.pem  issued.json  <name>.crt  <name>.key

A node needs ``ca.crt``, ``crl.pem`` and its own ``<name>.crt``/``<name>.key``; ``ca.key`` never
leaves the operator. ``crl.pem`` is the authority's signed revocation list: a listener re-reads
it when it changes and refuses revoked certificates from the next connection on.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import os
import re
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from intellect_jax.files import atomic_write
from intellect_jax.net.errors import AuthError

COORDINATOR = "coordinator"  # the coordinator's identity
OPERATOR = "operator"  # the operator's own identity (status queries)
RESERVED = frozenset({COORDINATOR, OPERATOR, "ca", "crl", "issued"})
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
CA_CERT, CA_KEY, CRL, INDEX = "ca.crt", "ca.key", "crl.pem", "issued.json"
DEFAULT_DAYS = 365
KEYS_ENV = "INTELLECT_KEYS"


class IdentityError(AuthError):
    """A missing, foreign, expired, revoked or malformed key or certificate (names the file)."""


def check_name(name: str) -> str:
    """An identity is 1-64 characters of ``[A-Za-z0-9._-]``, starting with a letter or digit."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise IdentityError(f"invalid identity {str(name)[:80]!r}: use 1-64 characters of A-Z a-z 0-9 . _ -")
    return name


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise IdentityError(f"{path}: no such {what}") from None
    except OSError as e:
        raise IdentityError(f"{path}: cannot read the {what} ({e.strerror})") from None


def _load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(_read(path, "certificate"))
    except ValueError:
        raise IdentityError(f"{path}: not a PEM certificate") from None


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(_read(path, "private key"), password=None)
    except (ValueError, TypeError):
        raise IdentityError(f"{path}: not an unencrypted PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise IdentityError(f"{path}: not an EC private key")
    return key


def common_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


class Revocations:
    """The authority's revocation list (``crl.pem``), re-read when the file changes; a list that
    is missing means nothing is revoked, one that is not signed by the authority is an error at
    start, and later (a damaged or half-copied file) a warning that keeps the last good list.
    A list can also arrive from the coordinator (:meth:`install`): checked against the authority
    the same way, and written to ``crl.pem``. A revocation is for good (the authority never lifts
    one), so a list is taken only if it revokes more than the one in force, whichever way each
    came: an old copy never brings a revoked identity back."""

    def __init__(self, path: Path | None, ca: x509.Certificate) -> None:
        self.path, self._ca = path, ca
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._serials: frozenset[int] = frozenset()
        self._crl: x509.CertificateRevocationList | None = None
        self._pem: bytes | None = None
        self._starting = True  # a bad list is an error at start only; later a warning
        self.refresh()
        self._starting = False

    def refresh(self) -> frozenset[int]:
        """Revoked serial numbers (re-reads the file if its size or mtime changed)."""
        if self.path is None:
            return self._serials
        with self._lock:
            try:
                st = self.path.stat()
            except OSError:  # no file (or no way to it): nothing revoked, or the list held already
                if self._crl is None:
                    self._stamp, self._serials = None, frozenset()
                return self._serials
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                try:
                    pem = _read(self.path, "revocation list")
                    self._adopt(self._parse(pem, str(self.path)), pem)
                except IdentityError as e:
                    if self._starting:
                        raise
                    # a damaged or half-copied list while running: keep the last good one
                    logging.getLogger("intellect_jax.net").warning("%s; keeping the revocation list read "
                                                                   "before", e)
                self._stamp = stamp
            return self._serials

    def install(self, pem: bytes, source: str) -> bool:
        """Take a revocation list that came from ``source``: IdentityError if the authority did
        not sign it; False if it revokes nothing more than the one in force; else it is in force (and
        written to ``crl.pem``, so a restart keeps it)."""
        crl = self._parse(pem, source)
        with self._lock:
            if not self._adopt(crl, pem):
                return False
            if self.path is not None:
                try:
                    atomic_write(self.path, pem)
                    st = self.path.stat()
                    self._stamp = (st.st_mtime_ns, st.st_size)
                except OSError as e:  # e.g. a read-only keys directory: in force in memory all the same
                    logging.getLogger("intellect_jax.net").warning("cannot keep the revocation list in %s (%s); "
                                                                   "it is in force until this process ends",
                                                                   self.path, e)
        logging.getLogger("intellect_jax.net").warning("revocation list from %s in force: %d identities revoked",
                                                       source, len(self._serials))
        return True

    def current(self) -> tuple[int, bytes] | None:
        """(identities revoked, PEM) of the list in force (the file re-read if it changed), or
        None: what the coordinator hands its members."""
        try:
            self.refresh()
        except IdentityError:  # (a file read at start that is gone bad: the last good list)
            pass
        with self._lock:
            return None if self._pem is None else (len(self._serials), self._pem)

    def _adopt(self, crl: x509.CertificateRevocationList, pem: bytes) -> bool:
        serials = frozenset(r.serial_number for r in crl)
        if self._crl is not None and not serials > self._serials:
            return False  # revokes nothing more: an old copy, or the same list again
        self._crl, self._pem, self._serials = crl, pem, serials
        return True

    def _parse(self, pem: bytes, source: str) -> x509.CertificateRevocationList:
        try:
            crl = x509.load_pem_x509_crl(pem)
        except ValueError:
            raise IdentityError(f"{source}: not a PEM revocation list") from None
        if not crl.is_signature_valid(self._ca.public_key()):  # type: ignore[arg-type]
            raise IdentityError(f"{source}: revocation list not signed by this run's authority")
        return crl

    def revoked(self, serial: int) -> bool:
        return serial in self.refresh()


@dataclass(frozen=True)
class Credentials:
    """One identity's key and certificate, the run authority's certificate, and its revocation
    list. :meth:`load` checks them all and fails in one line naming the file."""

    name: str
    ca: Path
    cert: Path
    key: Path
    revocations: Revocations = field(repr=False, compare=False)

    @classmethod
    def load(cls, keys_dir: str | os.PathLike[str], name: str) -> Credentials:
        """``<keys_dir>/{ca.crt, <name>.crt, <name>.key, crl.pem}``, checked: issued by the
        authority to ``name``, valid now, not revoked, key matching."""
        d = Path(keys_dir)
        check_name(name)
        if not d.is_dir():
            raise IdentityError(f"{d}: no such keys directory")
        ca_path, cert_path, key_path = d / CA_CERT, d / f"{name}.crt", d / f"{name}.key"
        ca = _load_cert(ca_path)
        if not cert_path.exists():
            raise IdentityError(f"identity {name}: no certificate {cert_path} "
                                f"(the operator issues one: python -m intellect_jax.keys issue {name})")
        cert, key = _load_cert(cert_path), _load_key(key_path)
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            raise IdentityError(f"{cert_path}: not issued by this run's authority {ca_path}") from None
        if common_name(cert) != name:
            raise IdentityError(f"{cert_path}: certificate of {common_name(cert)!r}, not of {name!r}")
        now = _now()
        if now > cert.not_valid_after_utc:
            raise IdentityError(f"{cert_path}: certificate of {name} expired on {cert.not_valid_after_utc:%Y-%m-%d}")
        if now < cert.not_valid_before_utc:
            raise IdentityError(f"{cert_path}: certificate of {name} not valid before "
                                f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M}")
        if key.public_key().public_numbers() != cert.public_key().public_numbers():  # type: ignore[union-attr]
            raise IdentityError(f"{key_path}: private key does not match {cert_path}")
        revocations = Revocations(d / CRL, ca)
        if revocations.revoked(cert.serial_number):
            raise IdentityError(f"identity {name} is revoked ({cert_path} is in {d / CRL})")
        return cls(name, ca_path, cert_path, key_path, revocations)

    def _context(self, purpose: int) -> ssl.SSLContext:
        ctx = ssl.SSLContext(purpose)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(self.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    @functools.cached_property
    def _private_key(self) -> ec.EllipticCurvePrivateKey:
        return _load_key(self.key)

    @functools.cached_property
    def ca_der(self) -> bytes:
        """The run authority's certificate (DER)."""
        return _load_cert(self.ca).public_bytes(serialization.Encoding.DER)

    @functools.cached_property
    def cert_der(self) -> bytes:
        """This identity's certificate (DER)."""
        return _load_cert(self.cert).public_bytes(serialization.Encoding.DER)

    def sign(self, data: bytes) -> bytes:
        """ECDSA-SHA256 signature of ``data`` with this identity's key (see :func:`verify`)."""
        return self._private_key.sign(data, ec.ECDSA(hashes.SHA256()))

    @functools.cached_property
    def server_context(self) -> ssl.SSLContext:
        """Mutual TLS 1.3, listening side: the client must present a certificate of the run."""
        ctx = self._context(ssl.PROTOCOL_TLS_SERVER)
        ctx.num_tickets = 0  # no session tickets: nothing arrives after the handshake but data
        return ctx

    @functools.cached_property
    def client_context(self) -> ssl.SSLContext:
        """Mutual TLS 1.3, connecting side. Peers are addressed by IP, so host names are not
        checked; the identity in the certificate is (see :func:`peer_identity`)."""
        ctx = self._context(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        return ctx


def keys_dir(path: str | os.PathLike[str] | None) -> Path:
    """The keys directory: ``path``, else ``$INTELLECT_KEYS``; one line if neither is set."""
    path = path or os.environ.get(KEYS_ENV)
    if not path:
        raise IdentityError(f"no keys directory: pass one (diloco.keys, --keys) or set ${KEYS_ENV}; "
                            "the run's operator makes it with python -m intellect_jax.keys")
    return Path(path)


def sole_identity(keys: str | os.PathLike[str]) -> str:
    """The one identity in ``keys`` that has a key and is not the run's own (a node's default)."""
    d = Path(keys)
    names = sorted(p.stem for p in d.glob("*.key") if p.stem not in RESERVED)
    if len(names) != 1:
        raise IdentityError(f"{d}: holds {len(names)} node identities ({', '.join(names[:5]) or 'none'}); "
                            "name this node's with diloco.node_id")
    return names[0]


def peer_identity(sock: ssl.SSLSocket) -> tuple[str, int, bytes]:
    """(identity, serial number, DER certificate) verified at the other end of ``sock``."""
    der = sock.getpeercert(binary_form=True)
    if not der:
        raise AuthError("peer presented no certificate")
    cert = x509.load_der_x509_certificate(der)
    return common_name(cert), cert.serial_number, der


def vote(run_id: str, outer_step: int, state_hash: str) -> bytes:
    """What a node signs when it states its state's hash at a barrier."""
    return f"intellect_jax vote\nrun {run_id}\nouter step {outer_step}\nstate {state_hash}".encode()


def record(run_id: str, outer_step: int, state_hash: str, epoch_id: int, members: Sequence[str]) -> bytes:
    """What the run's coordinator signs when a barrier records ``state_hash`` for ``outer_step``
    and forms epoch ``epoch_id`` of ``members`` (ring order): a node's proof that its state is
    the run's, for a coordinator that lost the run's history (``coordinator.claims``)."""
    return (f"intellect_jax record\nrun {run_id}\nouter step {outer_step}\nstate {state_hash}\nepoch {epoch_id}\n"
            f"members {','.join(members)}").encode()


def vouched(ca_der: bytes, cert_hex: str, name: str, data: bytes, signature_hex: str,
            revoked: Callable[[int], bool] | None = None) -> bool:
    """Whether ``signature_hex`` over ``data`` is by a certificate (``cert_hex``) that the
    authority ``ca_der`` issued to ``name`` and, if ``revoked`` (of its serial) is given, did not
    revoke (a record checked after the fact, e.g. the journal)."""
    try:
        cert, sig = bytes.fromhex(cert_hex), bytes.fromhex(signature_hex)
    except (ValueError, TypeError):
        return False
    serial = issued(ca_der, cert, name)
    return serial is not None and not (revoked is not None and revoked(serial)) and verify(cert, data, sig)


@functools.lru_cache(maxsize=1024)
def issued(ca_der: bytes, cert_der: bytes, name: str) -> int | None:
    """The serial number of ``cert_der`` if the authority ``ca_der`` issued it to ``name`` (a
    certificate a third party passed on), else None (kept: a coordinator checks many signatures
    by the same few certificates, and each check of the issuer is itself a signature check)."""
    try:
        ca, cert = x509.load_der_x509_certificate(ca_der), x509.load_der_x509_certificate(cert_der)
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return None
    return cert.serial_number if common_name(cert) == name else None


def verify(cert_der: bytes, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` over ``data`` was made with the key of the certificate ``cert_der``."""
    key = _public_key(bytes(cert_der))
    if key is None:
        return False
    try:
        key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


@functools.lru_cache(maxsize=1024)
def _public_key(cert_der: bytes) -> ec.EllipticCurvePublicKey | None:
    """The EC public key of a certificate (kept: the exchanges check every piece of a call
    against the same few certificates; parsing one is a fifth of a check)."""
    try:
        key = x509.load_der_x509_certificate(cert_der).public_key()
    except (ValueError, TypeError):
        return None
    return key if isinstance(key, ec.EllipticCurvePublicKey) else None


# ---- the operator's side -------------------------------------------------------------------------
class Authority:
    """The run's certificate authority in a keys directory (the operator's machine only)."""

    def __init__(self, keys_dir: Path, ca: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.dir, self.ca, self._key = keys_dir, ca, key

    @classmethod
    def init(cls, keys_dir: str | os.PathLike[str], run_id: str, days: int = DEFAULT_DAYS) -> Authority:
        """Make a new authority (refuses to overwrite one), with the coordinator's and the
        operator's identities and an empty revocation list."""
        d = Path(keys_dir)
        if (d / CA_KEY).exists() or (d / CA_CERT).exists():
            raise IdentityError(f"{d}: already holds a run authority ({CA_CERT}); use another directory")
        d.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"intellect_jax run authority {run_id}"[:64])])
        now = _now()
        ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
              .serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                           data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                           crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
              .sign(key, hashes.SHA256()))
        atomic_write(d / CA_KEY, _key_pem(key), mode=0o600)
        atomic_write(d / CA_CERT, ca.public_bytes(serialization.Encoding.PEM))
        auth = cls(d, ca, key)
        auth._write_index({})
        auth._write_crl(set())
        for who in (COORDINATOR, OPERATOR):
            auth.issue(who, days=days, reserved_ok=True)
        return auth

    @classmethod
    def load(cls, keys_dir: str | os.PathLike[str]) -> Authority:
        d = Path(keys_dir)
        ca, key = _load_cert(d / CA_CERT), _load_key(d / CA_KEY)
        if key.public_key().public_numbers() != ca.public_key().public_numbers():  # type: ignore[union-attr]
            raise IdentityError(f"{d / CA_KEY}: does not match {d / CA_CERT}")
        return cls(d, ca, key)

    def index(self) -> dict[str, list[dict[str, object]]]:
        """Every certificate issued, by identity: serial (hex), expiry, revoked."""
        path = self.dir / INDEX
        try:
            data = json.loads(_read(path, "index of issued certificates"))
        except ValueError:
            raise IdentityError(f"{path}: not a JSON index of issued certificates") from None
        if not isinstance(data, dict):
            raise IdentityError(f"{path}: not a JSON index of issued certificates")
        return data

    def _write_index(self, index: dict[str, list[dict[str, object]]]) -> None:
        atomic_write(self.dir / INDEX, json.dumps(index, indent=1, sort_keys=True).encode())

    def issue(self, name: str, days: int = DEFAULT_DAYS, *, reserved_ok: bool = False) -> tuple[Path, Path]:
        """Issue ``name`` a fresh key and certificate; returns (certificate, key) paths."""
        check_name(name)
        if name in RESERVED and not reserved_ok:
            raise IdentityError(f"identity {name!r} is reserved for the run itself")
        if days < 1:
            raise IdentityError(f"a certificate must be valid for at least a day, not {days}")
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        not_after = min(now + dt.timedelta(days=days), self.ca.not_valid_after_utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self.ca.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(not_after)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self._key, hashes.SHA256()))
        cert_path, key_path = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        atomic_write(key_path, _key_pem(key), mode=0o600)
        atomic_write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        index = self.index()
        index.setdefault(name, []).append({"serial": format(cert.serial_number, "x"),
                                           "not_after": f"{not_after:%Y-%m-%dT%H:%M:%SZ}", "revoked": False})
        self._write_index(index)
        return cert_path, key_path

    def revoke(self, name: str) -> int:
        """Revoke every certificate issued to ``name``; returns how many were newly revoked."""
        index = self.index()
        if name not in index:
            raise IdentityError(f"identity {name!r} was never issued by the authority in {self.dir}")
        if name in (COORDINATOR,):
            raise IdentityError("the coordinator's identity cannot be revoked; start a new run authority")
        fresh = [e for e in index[name] if not e["revoked"]]
        for e in fresh:
            e["revoked"] = True
        self._write_crl({int(str(e["serial"]), 16) for es in index.values() for e in es if e["revoked"]})
        self._write_index(index)
        return len(fresh)

    def _write_crl(self, serials: set[int]) -> None:
        now = _now()
        b = (x509.CertificateRevocationListBuilder().issuer_name(self.ca.subject)
             .last_update(now).next_update(self.ca.not_valid_after_utc))
        for s in sorted(serials):
            b = b.add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(s)
                                          .revocation_date(now).build())
        atomic_write(self.dir / CRL, b.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
