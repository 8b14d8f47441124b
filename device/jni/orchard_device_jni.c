/* JNI glue for org.orchard.device.OrchardDevice: each native method calls one function
 * of orchard_device.h and turns a failed status into an OrchardException with the
 * library's message. Nothing else lives here: the rules are the C library's.
 *
 * The Java handle is a pointer to a `binding`: the C handle, and the app's StateSource
 * (a global reference) that the C library's state callback calls back into. That
 * callback runs on the thread of the call that asked for the state, which is a Java
 * thread inside a native method, so it is attached already. */
#include <jni.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "orchard_device.h"

typedef struct binding {
  orchard_device* dev;
  JavaVM* vm;
  jobject source; /* global reference, or NULL */
} binding;

static binding* B(jlong h) { return (binding*)(intptr_t)h; }

static void throw_status(JNIEnv* env, int status, const char* message) {
  jclass cls = (*env)->FindClass(env, "org/orchard/device/OrchardDevice$OrchardException");
  if (cls == NULL) return; /* NoClassDefFoundError is pending */
  jmethodID ctor = (*env)->GetMethodID(env, cls, "<init>", "(ILjava/lang/String;Ljava/lang/String;)V");
  if (ctor == NULL) return;
  jstring name = (*env)->NewStringUTF(env, orchard_status_name(status));
  jstring msg = (*env)->NewStringUTF(env, message != NULL ? message : "");
  if (name == NULL || msg == NULL) return; /* OutOfMemoryError is pending */
  jobject ex = (*env)->NewObject(env, cls, ctor, (jint)status, name, msg);
  if (ex != NULL) (*env)->Throw(env, (jthrowable)ex);
}

/* Throw for a failed status; returns whether it did. */
static int failed(JNIEnv* env, binding* b, orchard_status st) {
  if (st == ORCHARD_OK) return 0;
  throw_status(env, st, orchard_device_errmsg(b->dev));
  return 1;
}

static int live(JNIEnv* env, jlong h) {
  if (h != 0) return 1;
  throw_status(env, ORCHARD_ERR_ARGUMENT, "the OrchardDevice is closed");
  return 0;
}

/* A Java string as a NUL-terminated C string the caller frees; NULL after throwing. */
static char* cstring(JNIEnv* env, jstring s, const char* what) {
  if (s == NULL) {
    char m[96];
    snprintf(m, sizeof m, "%s is null", what);
    throw_status(env, ORCHARD_ERR_ARGUMENT, m);
    return NULL;
  }
  const char* u = (*env)->GetStringUTFChars(env, s, NULL);
  if (u == NULL) return NULL;
  char* out = strdup(u);
  (*env)->ReleaseStringUTFChars(env, s, u);
  if (out == NULL) throw_status(env, ORCHARD_ERR_NOMEM, "out of memory");
  return out;
}

static void fill_report(JNIEnv* env, jobject out, const orchard_round_report* r) {
  jclass c = (*env)->GetObjectClass(env, out);
  (*env)->SetLongField(env, out, (*env)->GetFieldID(env, c, "round", "J"), r->round);
  (*env)->SetBooleanField(env, out, (*env)->GetFieldID(env, c, "uploaded", "Z"), r->uploaded ? JNI_TRUE : JNI_FALSE);
  (*env)->SetLongField(env, out, (*env)->GetFieldID(env, c, "numSteps", "J"), r->num_steps);
  (*env)->SetLongField(env, out, (*env)->GetFieldID(env, c, "numExamples", "J"), r->num_examples);
  (*env)->SetDoubleField(env, out, (*env)->GetFieldID(env, c, "weight", "D"), r->weight);
  (*env)->SetDoubleField(env, out, (*env)->GetFieldID(env, c, "trainLoss", "D"), r->train_loss);
  (*env)->SetBooleanField(env, out, (*env)->GetFieldID(env, c, "stoppedEarly", "Z"),
                          r->stopped_early ? JNI_TRUE : JNI_FALSE);
}

/* orchard_state_fn: the app's StateSource.read(), its DeviceState copied field by field. */
static int read_state(void* user, orchard_device_state* st) {
  binding* b = (binding*)user;
  JNIEnv* env = NULL;
  if ((*b->vm)->GetEnv(b->vm, (void**)&env, JNI_VERSION_1_6) != JNI_OK) return 1;
  jclass sc = (*env)->GetObjectClass(env, b->source);
  jmethodID read = (*env)->GetMethodID(env, sc, "read", "()Lorg/orchard/device/OrchardDevice$DeviceState;");
  if (read == NULL) return 2;
  jobject s = (*env)->CallObjectMethod(env, b->source, read);
  if ((*env)->ExceptionCheck(env)) {
    /* The app's exception fails the call with ORCHARD_ERR_DEVICE instead. */
    (*env)->ExceptionClear(env);
    return 3;
  }
  if (s == NULL) return 4;
  jclass c = (*env)->GetObjectClass(env, s);
  st->battery_percent = (*env)->GetDoubleField(env, s, (*env)->GetFieldID(env, c, "batteryPercent", "D"));
  st->charging = (*env)->GetIntField(env, s, (*env)->GetFieldID(env, c, "charging", "I"));
  st->temperature_c = (*env)->GetDoubleField(env, s, (*env)->GetFieldID(env, c, "temperatureC", "D"));
  st->thermal_status = (*env)->GetIntField(env, s, (*env)->GetFieldID(env, c, "thermalStatus", "I"));
  st->unmetered_network = (*env)->GetIntField(env, s, (*env)->GetFieldID(env, c, "unmeteredNetwork", "I"));
  st->idle = (*env)->GetIntField(env, s, (*env)->GetFieldID(env, c, "idle", "I"));
  st->energy_j = (*env)->GetDoubleField(env, s, (*env)->GetFieldID(env, c, "energyJ", "D"));
  (*env)->DeleteLocalRef(env, s);
  return 0;
}

#define FN(name) Java_org_orchard_device_OrchardDevice_##name

JNIEXPORT jstring JNICALL FN(version)(JNIEnv* env, jclass cls) {
  (void)cls;
  return (*env)->NewStringUTF(env, orchard_version());
}

JNIEXPORT jlong JNICALL FN(nativeOpen)(JNIEnv* env, jclass cls, jstring dir) {
  (void)cls;
  char* d = cstring(env, dir, "bundleDir");
  if (d == NULL) return 0;
  binding* b = calloc(1, sizeof *b);
  if (b == NULL) {
    free(d);
    throw_status(env, ORCHARD_ERR_NOMEM, "out of memory");
    return 0;
  }
  (*env)->GetJavaVM(env, &b->vm);
  orchard_status st = orchard_device_open(d, &b->dev);
  free(d);
  if (st != ORCHARD_OK) {
    throw_status(env, st, b->dev != NULL ? orchard_device_errmsg(b->dev) : "out of memory");
    orchard_device_close(b->dev);
    free(b);
    return 0;
  }
  return (jlong)(intptr_t)b;
}

JNIEXPORT void JNICALL FN(nativeClose)(JNIEnv* env, jclass cls, jlong h) {
  (void)cls;
  binding* b = B(h);
  if (b == NULL) return;
  orchard_device_close(b->dev);
  if (b->source != NULL) (*env)->DeleteGlobalRef(env, b->source);
  free(b);
}

JNIEXPORT jstring JNICALL FN(nativeErrmsg)(JNIEnv* env, jclass cls, jlong h) {
  (void)cls;
  return (*env)->NewStringUTF(env, h == 0 ? "" : orchard_device_errmsg(B(h)->dev));
}

JNIEXPORT void JNICALL FN(nativeSetOption)(JNIEnv* env, jclass cls, jlong h, jstring name, jstring value) {
  (void)cls;
  if (!live(env, h)) return;
  char* n = cstring(env, name, "name");
  char* v = n == NULL ? NULL : cstring(env, value, "value");
  if (v != NULL) failed(env, B(h), orchard_device_set_option(B(h)->dev, n, v));
  free(n);
  free(v);
}

JNIEXPORT void JNICALL FN(nativeSetStateSource)(JNIEnv* env, jclass cls, jlong h, jobject source) {
  (void)cls;
  if (!live(env, h)) return;
  binding* b = B(h);
  jobject ref = source == NULL ? NULL : (*env)->NewGlobalRef(env, source);
  if (source != NULL && ref == NULL) return;
  orchard_status st = orchard_device_set_state_source(b->dev, ref == NULL ? NULL : read_state, b);
  if (st != ORCHARD_OK) {
    if (ref != NULL) (*env)->DeleteGlobalRef(env, ref);
    failed(env, b, st);
    return;
  }
  if (b->source != NULL) (*env)->DeleteGlobalRef(env, b->source);
  b->source = ref;
}

JNIEXPORT jint JNICALL FN(nativeCheckEligibility)(JNIEnv* env, jclass cls, jlong h) {
  (void)cls;
  int reasons = 0;
  if (!live(env, h)) return 0;
  failed(env, B(h), orchard_device_check_eligibility(B(h)->dev, &reasons));
  return reasons;
}

JNIEXPORT void JNICALL FN(nativeJoin)(JNIEnv* env, jclass cls, jlong h) {
  (void)cls;
  if (live(env, h)) failed(env, B(h), orchard_device_join(B(h)->dev));
}

JNIEXPORT jstring JNICALL FN(nativeNodeId)(JNIEnv* env, jclass cls, jlong h) {
  (void)cls;
  return (*env)->NewStringUTF(env, h == 0 ? "" : orchard_device_node_id(B(h)->dev));
}

JNIEXPORT void JNICALL FN(nativeSetText)(JNIEnv* env, jclass cls, jlong h, jbyteArray utf8) {
  (void)cls;
  if (!live(env, h)) return;
  if (utf8 == NULL) {
    throw_status(env, ORCHARD_ERR_ARGUMENT, "text is null");
    return;
  }
  jsize n = (*env)->GetArrayLength(env, utf8);
  jbyte* bytes = (*env)->GetByteArrayElements(env, utf8, NULL);
  if (bytes == NULL) return;
  orchard_status st = orchard_device_set_text(B(h)->dev, (const char*)bytes, (size_t)n);
  (*env)->ReleaseByteArrayElements(env, utf8, bytes, JNI_ABORT);
  failed(env, B(h), st);
}

JNIEXPORT void JNICALL FN(nativeParticipate)(JNIEnv* env, jclass cls, jlong h, jdouble max_wait_s, jobject out) {
  (void)cls;
  orchard_round_report r;
  if (!live(env, h)) return;
  if (failed(env, B(h), orchard_device_participate(B(h)->dev, max_wait_s, &r))) return;
  fill_report(env, out, &r);
}

JNIEXPORT void JNICALL FN(nativeTrainLocal)(JNIEnv* env, jclass cls, jlong h, jlong steps, jlong batch, jdouble lr,
                                            jobject out) {
  (void)cls;
  orchard_round_report r;
  if (!live(env, h)) return;
  if (failed(env, B(h), orchard_device_train_local(B(h)->dev, steps, batch, lr, &r))) return;
  fill_report(env, out, &r);
}

JNIEXPORT void JNICALL FN(nativeCancel)(JNIEnv* env, jclass cls, jlong h) {
  (void)env;
  (void)cls;
  if (h != 0) orchard_device_cancel(B(h)->dev);
}
